// SPDX-License-Identifier: Apache-2.0
//! The scheduler: runs a profile's plugins over a snapshot.

use std::collections::HashMap;

use crate::config::{DEFAULT_PROFILE, ReplicaConfig, SchedulerConfig};
use crate::error::{SchedError, SchedResult, Unschedulable};
use crate::framework::{
    Ctx, CycleState, FilterChain, FilterPlugin, PreFilterPlugin, PreFilterResult, PreScoreResult,
    Profile, Reason, ScorePlugin, num_feasible_nodes_to_find,
};
use crate::intern::{Labels, Sym};
use crate::plugins::ResourceFitArgs;
use crate::snapshot::ClusterSnapshot;
use crate::types::{Placement, Request, Resources};

/// Places VMs (and volume replicas) on the nodes of a [`ClusterSnapshot`].
///
/// The scheduler holds its profiles, a rotating start index for node
/// sampling (kube-scheduler's `nextStartNodeIndex`) and scratch buffers that
/// are reused across decisions. Given the same sequence of calls on the same
/// snapshots, it returns the same placements: ties go to the first node in
/// scan order.
#[derive(Debug)]
pub struct Scheduler {
    profiles: Vec<Profile>,
    pub(crate) replicas: ReplicaConfig,
    next_start: usize,
    scratch: Scratch,
}

#[derive(Debug, Default)]
struct Scratch {
    /// Node slots of the batch being filtered, and their results.
    chunk: Vec<u32>,
    results: Vec<Option<Reason>>,
    feasible: Vec<u32>,
    failed: Vec<(u32, Reason)>,
    scores: Vec<i64>,
    totals: Vec<i64>,
    /// Raw-score caches of `resources_only` scorers, by profile and plugin
    /// position.
    caches: Vec<Vec<ScoreCache>>,
    /// Cache misses of one batch: slots, their positions, their scores.
    miss_slots: Vec<u32>,
    miss_at: Vec<usize>,
    miss_scores: Vec<i64>,
    state: CycleState,
}

/// The outcome of one scheduling cycle, before binding.
struct Cycle {
    placement: Placement,
    state: CycleState,
    profile: usize,
    slot: u32,
}

impl Default for Scheduler {
    fn default() -> Self {
        Self::with_profiles(vec![Profile::with_defaults(
            DEFAULT_PROFILE,
            ResourceFitArgs::default(),
        )])
        .unwrap_or_else(|_| unreachable!("one profile is valid"))
    }
}

impl TryFrom<SchedulerConfig> for Scheduler {
    type Error = SchedError;

    fn try_from(cfg: SchedulerConfig) -> SchedResult<Self> {
        let profiles = if cfg.profiles.is_empty() {
            vec![Profile::with_defaults(
                DEFAULT_PROFILE,
                ResourceFitArgs::default(),
            )]
        } else {
            cfg.profiles
                .iter()
                .map(|p| p.build())
                .collect::<SchedResult<Vec<_>>>()?
        };
        let mut s = Self::with_profiles(profiles)?;
        s.replicas = cfg.replicas;
        Ok(s)
    }
}

impl Scheduler {
    /// A scheduler with the default profile.
    pub fn new() -> Self {
        Self::default()
    }

    /// A scheduler with custom profiles; the first is used when a request
    /// names none. Fails on an empty list or duplicate names.
    pub fn with_profiles(profiles: Vec<Profile>) -> SchedResult<Self> {
        if profiles.is_empty() {
            return Err(SchedError::InvalidConfig {
                reason: "no profiles".into(),
            });
        }
        for (i, p) in profiles.iter().enumerate() {
            if profiles[..i].iter().any(|q| q.name == p.name) {
                return Err(SchedError::InvalidConfig {
                    reason: format!("duplicate profile {}", p.name),
                });
            }
        }
        Ok(Self {
            profiles,
            replicas: ReplicaConfig::default(),
            next_start: 0,
            scratch: Scratch::default(),
        })
    }

    /// The profiles.
    pub fn profiles(&self) -> &[Profile] {
        &self.profiles
    }

    /// Chooses a node for `request` without changing the snapshot.
    ///
    /// Runs pre-filter, filter (on a sample of nodes, see
    /// [`Profile::percentage_of_nodes_to_score`]), post-filter (preemption)
    /// when nothing fits, pre-score, score, normalize, then reserve and
    /// permit on the chosen node. The caller then records the decision with
    /// [`ClusterSnapshot::bind`] (after evicting `victims`), or uses
    /// [`Scheduler::schedule`] which does all of it.
    ///
    /// Errors: [`SchedError::Unschedulable`] when no node fits (with
    /// kube-scheduler-style reasons), [`SchedError::Rejected`] when a reserve
    /// or permit plugin refused, [`SchedError::UnknownProfile`].
    pub fn place(
        &mut self,
        snapshot: &ClusterSnapshot,
        request: &Request,
    ) -> SchedResult<Placement> {
        let c = self.cycle(snapshot, request, true)?;
        self.scratch.state = c.state;
        Ok(c.placement)
    }

    /// [`place`](Self::place), then run the bind plugins, evict the victims
    /// from the snapshot and bind the VM in it. On error the snapshot is
    /// unchanged.
    pub fn schedule(
        &mut self,
        snapshot: &mut ClusterSnapshot,
        request: &Request,
    ) -> SchedResult<Placement> {
        if snapshot.vm_by_name(&request.name).is_some() {
            return Err(SchedError::VmExists {
                vm: request.name.clone(),
            });
        }
        let mut c = self.cycle(snapshot, request, true)?;
        self.run_bind(snapshot, request, &mut c)?;
        for v in &c.placement.victims {
            snapshot.unbind(v)?;
        }
        snapshot.bind(request, &c.placement.node)?;
        self.scratch.state = c.state;
        Ok(c.placement)
    }

    /// Places a group all-or-nothing (gang scheduling): each member is
    /// placed and bound in turn, seeing the members before it; if any member
    /// does not fit, every member placed so far is unreserved and unbound and
    /// the snapshot is left as it was. Bind plugins run only once every
    /// member has a node (members "wait at permit" for the whole gang).
    /// Gang members never preempt.
    pub fn place_gang(
        &mut self,
        snapshot: &mut ClusterSnapshot,
        requests: &[Request],
    ) -> SchedResult<Vec<Placement>> {
        let mut done: Vec<Cycle> = Vec::with_capacity(requests.len());
        for (index, req) in requests.iter().enumerate() {
            let res = self
                .cycle(snapshot, req, false)
                .and_then(|c| snapshot.bind(req, &c.placement.node).map(|()| c));
            match res {
                Ok(c) => done.push(c),
                Err(e) => {
                    self.rollback_gang(snapshot, requests, done);
                    return Err(SchedError::Gang {
                        index,
                        member: req.name.clone(),
                        cause: Box::new(e),
                    });
                }
            }
        }
        for i in 0..done.len() {
            let req = &requests[i];
            let bound = {
                let c = &done[i];
                let labels = request_labels(snapshot, req);
                let cx = Ctx {
                    snapshot,
                    request: req,
                    labels: &labels,
                };
                bind_plugins(&self.profiles[c.profile], &cx, c)
            };
            if let Err(e) = bound {
                self.rollback_gang(snapshot, requests, done);
                return Err(SchedError::Gang {
                    index: i,
                    member: req.name.clone(),
                    cause: Box::new(e),
                });
            }
        }
        Ok(done.into_iter().map(|c| c.placement).collect())
    }

    fn rollback_gang(
        &self,
        snapshot: &mut ClusterSnapshot,
        requests: &[Request],
        done: Vec<Cycle>,
    ) {
        for (i, mut c) in done.into_iter().enumerate().rev() {
            let req = &requests[i];
            {
                let labels = request_labels(snapshot, req);
                let cx = Ctx {
                    snapshot,
                    request: req,
                    labels: &labels,
                };
                unreserve(&self.profiles[c.profile], &cx, &mut c.state, c.slot);
            }
            // The member was bound by place_gang, so this cannot fail.
            let _ = snapshot.unbind(&req.name);
        }
    }

    fn run_bind(
        &self,
        snapshot: &ClusterSnapshot,
        request: &Request,
        c: &mut Cycle,
    ) -> SchedResult<()> {
        let labels = request_labels(snapshot, request);
        let cx = Ctx {
            snapshot,
            request,
            labels: &labels,
        };
        let profile = &self.profiles[c.profile];
        let res = bind_plugins(profile, &cx, c);
        if res.is_err() {
            unreserve(profile, &cx, &mut c.state, c.slot);
        }
        res
    }

    fn profile_index(&self, request: &Request) -> SchedResult<usize> {
        match &request.profile {
            None => Ok(0),
            Some(name) => self
                .profiles
                .iter()
                .position(|p| &p.name == name)
                .ok_or_else(|| SchedError::UnknownProfile {
                    profile: name.clone(),
                }),
        }
    }

    /// One scheduling cycle up to and including permit.
    fn cycle(
        &mut self,
        snap: &ClusterSnapshot,
        req: &Request,
        allow_preemption: bool,
    ) -> SchedResult<Cycle> {
        let pi = self.profile_index(req)?;
        let Scheduler {
            profiles,
            next_start,
            scratch,
            ..
        } = self;
        let profile = &profiles[pi];
        let labels = request_labels(snap, req);
        let cx = Ctx {
            snapshot: snap,
            request: req,
            labels: &labels,
        };
        let mut state = std::mem::take(&mut scratch.state);
        state.clear();

        // PreFilter.
        let mut pre_filters: Vec<&dyn PreFilterPlugin> = Vec::new();
        let mut filters: Vec<&dyn FilterPlugin> = Vec::new();
        let mut narrowed: Vec<(Vec<u32>, Reason)> = Vec::new();
        for r in &profile.plugins {
            let p = &r.plugin;
            let mut skip = false;
            if let Some(pf) = p.as_pre_filter() {
                match pf.pre_filter(&cx, &mut state) {
                    Ok(PreFilterResult::Continue) => pre_filters.push(pf),
                    Ok(PreFilterResult::Skip) => skip = true,
                    Ok(PreFilterResult::Nodes { slots, reason }) => {
                        pre_filters.push(pf);
                        narrowed.push((slots, reason));
                    }
                    Err(reason) => {
                        let mut u = Unschedulable::new(&req.name, snap.node_count() as u32, []);
                        let mut msgs = Vec::new();
                        reason.messages(&snap.interner, |m| msgs.push(m));
                        u = Unschedulable::new(
                            u.subject,
                            u.total_nodes,
                            msgs.into_iter().map(|m| (m, snap.node_count() as u32)),
                        );
                        scratch.state = state;
                        return Err(u.into());
                    }
                }
            }
            if !skip && let Some(f) = p.as_filter() {
                filters.push(f);
            }
        }
        let chain = FilterChain {
            pre_filters: &pre_filters,
            filters: &filters,
        };

        // Candidates: all slots, or the intersection of narrowed lists.
        let intersection: Option<Vec<u32>> = (narrowed.len() > 1).then(|| {
            let mut acc = narrowed[0].0.clone();
            for (slots, _) in &narrowed[1..] {
                acc.retain(|s| slots.binary_search(s).is_ok());
            }
            acc
        });
        let candidates: Option<&[u32]> = match narrowed.as_slice() {
            [] => None,
            [(only, _)] => Some(only),
            _ => intersection.as_deref(),
        };

        // Filter, on a rotating sample.
        let total_nodes = snap.node_count();
        let n_cand = candidates.map_or(total_nodes, <[u32]>::len);
        let to_find = num_feasible_nodes_to_find(profile.percentage_of_nodes_to_score, n_cand);
        let feasible = &mut scratch.feasible;
        let failed = &mut scratch.failed;
        feasible.clear();
        failed.clear();
        let slots = snap.nodes.len();
        let mut evaluated = 0usize;
        if slots > 0 {
            let start = *next_start % slots;
            let mut run = FilterRun {
                snap,
                cx: &cx,
                state: &state,
                filters: &filters,
                to_find,
                feasible,
                failed,
                chunk: &mut scratch.chunk,
                results: &mut scratch.results,
            };
            // Visit [start, end) then [0, start) without a division per node.
            evaluated = match candidates {
                None => run.run((start..slots).chain(0..start).map(|s| s as u32)),
                Some(list) => {
                    let first = list.partition_point(|&s| (s as usize) < start);
                    run.run(list[first..].iter().chain(&list[..first]).copied())
                }
            };
            *next_start = (start + evaluated) % slots;
        }

        if feasible.is_empty() {
            // Nodes the indexes excluded fail with their plugin's reason.
            if let Some(cand) = candidates {
                for n in snap.nodes() {
                    if cand.binary_search(&n.slot).is_ok() {
                        continue;
                    }
                    if let Some((_, r)) = narrowed
                        .iter()
                        .find(|(l, _)| l.binary_search(&n.slot).is_err())
                    {
                        failed.push((n.slot, r.clone()));
                    }
                }
            }
            let mut preemption = None;
            if allow_preemption {
                for r in &profile.plugins {
                    let Some(pf) = r.plugin.as_post_filter() else {
                        continue;
                    };
                    match pf.post_filter(&cx, &state, &chain, failed) {
                        Ok(nom) => {
                            let node = &snap.nodes[nom.node as usize];
                            let victims = nom
                                .victims
                                .iter()
                                .filter_map(|&id| snap.vm(id))
                                .map(|v| v.name.clone())
                                .collect();
                            let placement = Placement {
                                node: node.name().to_string(),
                                victims,
                                score: 0,
                                evaluated_nodes: evaluated as u32,
                                feasible_nodes: 0,
                            };
                            return finish(profile, &cx, state, pi, nom.node, placement);
                        }
                        Err(msg) => preemption = Some(msg),
                    }
                }
            }
            let mut counts: Vec<(Reason, u32)> = Vec::new();
            for (_, r) in failed.iter() {
                match counts.iter_mut().find(|(x, _)| x == r) {
                    Some(e) => e.1 += 1,
                    None => counts.push((r.clone(), 1)),
                }
            }
            let mut lines: HashMap<String, u32> = HashMap::new();
            for (r, c) in counts {
                r.messages(&snap.interner, |m| *lines.entry(m).or_insert(0) += c);
            }
            let mut u = Unschedulable::new(&req.name, total_nodes as u32, lines);
            u.preemption = preemption;
            scratch.state = state;
            return Err(u.into());
        }

        // Score.
        let nf = feasible.len();
        let (best, best_score) = if nf == 1 {
            (feasible[0], 0)
        } else {
            let mut scorers: Vec<(&dyn ScorePlugin, i64, Option<usize>)> = Vec::new();
            let caches = &mut scratch.caches;
            if caches.len() < profiles.len() {
                caches.resize_with(profiles.len(), Vec::new);
            }
            let caches = &mut caches[pi];
            if caches.len() < profile.plugins.len() {
                caches.resize_with(profile.plugins.len(), ScoreCache::default);
            }
            for (pos, r) in profile.plugins.iter().enumerate() {
                if r.weight == 0 {
                    continue;
                }
                let Some(s) = r.plugin.as_score() else {
                    continue;
                };
                if let Some(ps) = r.plugin.as_pre_score()
                    && ps.pre_score(&cx, &mut state, feasible) == PreScoreResult::Skip
                {
                    continue;
                }
                let cache = s.resources_only().then(|| {
                    caches[pos].begin(req.resources, snap.nodes.len());
                    pos
                });
                scorers.push((s, r.weight, cache));
            }
            let totals = &mut scratch.totals;
            totals.clear();
            totals.resize(nf, 0);
            // Raw scores, one row per scorer, filled a batch of nodes at a
            // time so each node is loaded once for all scorers.
            let scores = &mut scratch.scores;
            scores.clear();
            scores.resize(nf * scorers.len(), 0);
            for (b, batch) in feasible.chunks(SCORE_BATCH).enumerate() {
                let at = b * SCORE_BATCH;
                for (k, (s, _, cache)) in scorers.iter().enumerate() {
                    let row = k * nf + at;
                    let out = &mut scores[row..row + batch.len()];
                    match cache {
                        None => s.score_batch(&cx, &state, batch, out),
                        Some(c) => {
                            let misses = Misses {
                                slots: &mut scratch.miss_slots,
                                at: &mut scratch.miss_at,
                                scores: &mut scratch.miss_scores,
                            };
                            caches[*c].score_batch(*s, &cx, &state, batch, out, misses);
                        }
                    }
                }
            }
            for (row, (s, w, _)) in scores.chunks_mut(nf).zip(&scorers) {
                s.normalize(&cx, &state, row);
                for (t, v) in totals.iter_mut().zip(row.iter()) {
                    *t = t.saturating_add(w.saturating_mul(*v));
                }
            }
            let mut bi = 0;
            for i in 1..nf {
                if totals[i] > totals[bi] {
                    bi = i;
                }
            }
            (feasible[bi], totals[bi])
        };
        let placement = Placement {
            node: snap.nodes[best as usize].name().to_string(),
            victims: Vec::new(),
            score: best_score,
            evaluated_nodes: evaluated as u32,
            feasible_nodes: nf as u32,
        };
        finish(profile, &cx, state, pi, best, placement)
    }
}

/// Raw scores of one `resources_only` scorer, per node slot, valid while
/// the node's stamp and the request's resources are unchanged.
#[derive(Debug, Default)]
struct ScoreCache {
    /// Resources of the requests the current epoch's entries were scored for.
    want: Resources,
    /// Bumped whenever `want` changes (entries of older epochs are stale);
    /// never 0 once scoring started.
    epoch: u32,
    entries: Vec<CacheEntry>,
}

/// 16 bytes, so the cache of 5,000 nodes stays small.
#[derive(Clone, Copy, Debug, Default)]
struct CacheEntry {
    /// Node stamp scored (0 = empty; stamps are never 0).
    stamp: u64,
    epoch: u32,
    /// Only scores that fit are cached.
    score: i32,
}

/// Scratch buffers for a batch's cache misses.
struct Misses<'a> {
    slots: &'a mut Vec<u32>,
    at: &'a mut Vec<usize>,
    scores: &'a mut Vec<i64>,
}

impl ScoreCache {
    /// Starts a cycle scoring a request for `want` on `slots` node slots.
    fn begin(&mut self, want: Resources, slots: usize) {
        if want != self.want || self.epoch == 0 {
            self.want = want;
            self.epoch = self.epoch.wrapping_add(1);
            if self.epoch == 0 {
                // Wrapped: forget everything rather than trust old epochs.
                self.entries.fill(CacheEntry::default());
                self.epoch = 1;
            }
        }
        if self.entries.len() < slots {
            self.entries.resize(slots, CacheEntry::default());
        }
    }

    /// `s.score_batch` through the cache: hits are copied, misses scored
    /// in one batch and remembered.
    fn score_batch(
        &mut self,
        s: &dyn ScorePlugin,
        cx: &Ctx<'_>,
        state: &CycleState,
        batch: &[u32],
        out: &mut [i64],
        m: Misses<'_>,
    ) {
        m.slots.clear();
        m.at.clear();
        let stamps = &cx.snapshot.stamps;
        for (i, (&slot, o)) in batch.iter().zip(out.iter_mut()).enumerate() {
            let e = &self.entries[slot as usize];
            if e.stamp == stamps[slot as usize] && e.epoch == self.epoch {
                *o = i64::from(e.score);
            } else {
                m.slots.push(slot);
                m.at.push(i);
            }
        }
        if m.slots.is_empty() {
            return;
        }
        m.scores.clear();
        m.scores.resize(m.slots.len(), 0);
        s.score_batch(cx, state, m.slots, m.scores);
        for ((&slot, &i), &v) in m.slots.iter().zip(m.at.iter()).zip(m.scores.iter()) {
            out[i] = v;
            if let Ok(score) = i32::try_from(v) {
                self.entries[slot as usize] = CacheEntry {
                    stamp: stamps[slot as usize],
                    epoch: self.epoch,
                    score,
                };
            }
        }
    }
}

/// Nodes scored per [`ScorePlugin::score_batch`] call.
const SCORE_BATCH: usize = 64;
/// Largest batch of nodes handed to [`FilterPlugin::filter_batch`].
const FILTER_BATCH: usize = 64;
/// Smallest batch while more feasible nodes are wanted (a few nodes past the
/// last one needed may be filtered; their results are dropped).
const FILTER_BATCH_MIN: usize = 16;

/// The filter phase of one cycle: visits nodes in scan order, in batches,
/// until `to_find` are feasible.
struct FilterRun<'a, 'c> {
    snap: &'a ClusterSnapshot,
    cx: &'a Ctx<'c>,
    state: &'a CycleState,
    filters: &'a [&'a dyn FilterPlugin],
    to_find: usize,
    feasible: &'a mut Vec<u32>,
    failed: &'a mut Vec<(u32, Reason)>,
    chunk: &'a mut Vec<u32>,
    results: &'a mut Vec<Option<Reason>>,
}

impl FilterRun<'_, '_> {
    /// Filters the live nodes of `order` and returns how many were
    /// evaluated. Results are exactly those of filtering one node at a time
    /// and stopping at the `to_find`-th feasible node: a batch never runs
    /// past that node by more than `FILTER_BATCH_MIN`, and what it
    /// evaluated beyond it is discarded.
    fn run(&mut self, order: impl Iterator<Item = u32>) -> usize {
        let nodes = &self.snap.nodes;
        let mut order = order.filter(|&s| nodes[s as usize].alive);
        let mut evaluated = 0;
        while self.feasible.len() < self.to_find {
            let want = (self.to_find - self.feasible.len()).clamp(FILTER_BATCH_MIN, FILTER_BATCH);
            self.chunk.clear();
            self.chunk.extend(order.by_ref().take(want));
            if self.chunk.is_empty() {
                break;
            }
            self.results.clear();
            self.results.resize(self.chunk.len(), None);
            for f in self.filters {
                f.filter_batch(self.cx, self.state, self.chunk, self.results);
            }
            self.failed.reserve(self.chunk.len());
            for (&s, r) in self.chunk.iter().zip(self.results.iter_mut()) {
                evaluated += 1;
                match r.take() {
                    None => {
                        self.feasible.push(s);
                        if self.feasible.len() >= self.to_find {
                            break;
                        }
                    }
                    Some(r) => self.failed.push((s, r)),
                }
            }
        }
        evaluated
    }
}

/// The request's labels as symbols. A value no node or VM uses maps to
/// [`Sym::UNKNOWN`]: no `In` matches it, but `Exists` and `DoesNotExist`
/// still see the key. A key nobody uses is dropped (no selector names it).
pub(crate) fn request_labels(snap: &ClusterSnapshot, req: &Request) -> Labels {
    let mut v: Vec<(Sym, Sym)> = req
        .labels
        .iter()
        .filter_map(|(k, v)| {
            Some((
                snap.interner.get(k)?,
                snap.interner.get(v).unwrap_or(Sym::UNKNOWN),
            ))
        })
        .collect();
    v.sort_unstable();
    v
}

/// Reserve and permit on the chosen node.
fn finish(
    profile: &Profile,
    cx: &Ctx<'_>,
    mut state: CycleState,
    pi: usize,
    slot: u32,
    placement: Placement,
) -> SchedResult<Cycle> {
    let node = &cx.snapshot.nodes[slot as usize];
    for r in &profile.plugins {
        if let Some(p) = r.plugin.as_reserve()
            && let Err(message) = p.reserve(cx, &mut state, node)
        {
            unreserve(profile, cx, &mut state, slot);
            return Err(rejected(r.plugin.name(), "reserve", cx, message));
        }
    }
    for r in &profile.plugins {
        if let Some(p) = r.plugin.as_permit()
            && let Err(message) = p.permit(cx, &state, node)
        {
            unreserve(profile, cx, &mut state, slot);
            return Err(rejected(r.plugin.name(), "permit", cx, message));
        }
    }
    Ok(Cycle {
        placement,
        state,
        profile: pi,
        slot,
    })
}

/// Runs the bind plugins; on failure the caller unreserves.
fn bind_plugins(profile: &Profile, cx: &Ctx<'_>, c: &Cycle) -> SchedResult<()> {
    let node = &cx.snapshot.nodes[c.slot as usize];
    for r in &profile.plugins {
        if let Some(p) = r.plugin.as_bind()
            && let Err(message) = p.bind(cx, &c.state, node)
        {
            return Err(rejected(r.plugin.name(), "bind", cx, message));
        }
    }
    Ok(())
}

fn unreserve(profile: &Profile, cx: &Ctx<'_>, state: &mut CycleState, slot: u32) {
    let node = &cx.snapshot.nodes[slot as usize];
    for r in profile.plugins.iter().rev() {
        if let Some(p) = r.plugin.as_reserve() {
            p.unreserve(cx, state, node);
        }
    }
}

fn rejected(plugin: &str, point: &'static str, cx: &Ctx<'_>, message: String) -> SchedError {
    SchedError::Rejected {
        plugin: plugin.to_string(),
        point,
        subject: cx.request.name.clone(),
        message,
    }
}
