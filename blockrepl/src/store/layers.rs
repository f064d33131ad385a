// SPDX-License-Identifier: Apache-2.0
//! Snapshots, revert, resize and diagnostics.

use super::*;

impl Store {
    /// Ordered: freezes the head as snapshot `name` and starts a new empty
    /// head `new_head`.
    pub fn snapshot(&mut self, tag: Tag, name: &str, new_head: u64) -> Result<()> {
        if name.is_empty() || name.len() > MAX_NAME_LEN {
            return Err(Error::InvalidArgument(format!(
                "bad snapshot name {name:?}"
            )));
        }
        if self.layers.len() >= MAX_LAYERS {
            return Err(Error::InvalidArgument("too many snapshots".into()));
        }
        if self.layer_index(new_head).is_some() || self.sb.layers.iter().any(|l| l.name == name) {
            return Err(Error::InvalidArgument(format!("snapshot {name:?} exists")));
        }
        self.checkpoint()?;
        let info = LayerInfo {
            id: new_head,
            name: String::new(),
            created: tag,
        };
        let layer = Self::open_layer(&*self.dir, info.clone(), true)?;
        self.dir.sync_dir().map_err(Error::store("snapshot"))?;
        if let Some(h) = self.layers.last_mut() {
            h.info.name = name.to_string();
            h.info.created = tag;
        }
        self.layers.push(layer);
        self.sb.layers = self.layers.iter().map(|l| l.info.clone()).collect();
        self.position = tag;
        self.sb.position = tag;
        self.write_sb()?;
        // The frozen layer takes no more large writes: its pool goes back.
        self.reclaim_ext_now();
        Ok(())
    }

    /// Ordered: deletes snapshot layer `layer`, merging the blocks it holds
    /// that its child does not into the child first.
    pub fn delete_snapshot(&mut self, tag: Tag, layer: u64) -> Result<()> {
        let li = self
            .layer_index(layer)
            .ok_or_else(|| Error::InvalidArgument(format!("no layer {layer}")))?;
        if li + 1 == self.layers.len() {
            return Err(Error::InvalidArgument("cannot delete the head".into()));
        }
        self.checkpoint()?;
        let mut moved: Vec<u64> = self.layers[li]
            .blocks
            .keys()
            .filter(|b| !self.layers[li + 1].blocks.contains_key(*b))
            .collect();
        moved.sort_unstable();
        let mut buf = vec![0u8; BLOCK_SIZE];
        for b in moved {
            let Some(e) = self.layers[li].blocks.get(b).copied() else {
                continue;
            };
            let mut e2 = e;
            if !self.read_entry(li, b, &e, &mut buf) {
                // Keep the damage visible in the child instead of copying
                // garbage, with the tag of the write it lost: a peer's copy
                // of that write (in any state) can still repair it, also
                // after a restart (seed 5683: an all-ones marker lost the
                // tag and left a block no peer could prove).
                e2.loc = Loc::Damaged;
                e2.meta.flags |= META_DAMAGED;
            } else {
                if !e.meta.is_zero() {
                    self.layers[li + 1]
                        .data
                        .write_at(&buf, b * BLOCK_SIZE_U64)
                        .map_err(Error::store("merge snapshot"))?;
                }
                e2.loc = Loc::Layer;
            }
            let mb = e2.meta.encode();
            self.layers[li + 1]
                .meta
                .write_at(&mb, b * META_SIZE as u64)
                .map_err(Error::store("merge snapshot"))?;
            self.layers[li + 1].blocks.insert(b, e2);
        }
        self.layers[li + 1]
            .data
            .sync()
            .map_err(Error::store("merge snapshot"))?;
        self.layers[li + 1]
            .meta
            .sync()
            .map_err(Error::store("merge snapshot"))?;
        let removed = self.layers.remove(li);
        self.sb.layers = self.layers.iter().map(|l| l.info.clone()).collect();
        self.position = tag;
        self.sb.position = tag;
        self.write_sb()?;
        self.remove_layer_files(removed)
    }

    /// Ordered: reverts to snapshot `layer`: drops every layer above it and
    /// starts a new empty head `new_head` on top of it.
    pub fn revert(&mut self, tag: Tag, layer: u64, new_head: u64) -> Result<()> {
        let li = self
            .layer_index(layer)
            .ok_or_else(|| Error::InvalidArgument(format!("no layer {layer}")))?;
        if li + 1 == self.layers.len() {
            return Err(Error::InvalidArgument("cannot revert to the head".into()));
        }
        if self.layer_index(new_head).is_some() {
            return Err(Error::InvalidArgument("new head id in use".into()));
        }
        self.checkpoint()?;
        let info = LayerInfo {
            id: new_head,
            name: String::new(),
            created: tag,
        };
        let head = Self::open_layer(&*self.dir, info, true)?;
        self.dir.sync_dir().map_err(Error::store("revert"))?;
        let dropped: Vec<Layer> = self.layers.drain(li + 1..).collect();
        self.layers.push(head);
        self.sb.layers = self.layers.iter().map(|l| l.info.clone()).collect();
        self.position = tag;
        self.sb.position = tag;
        self.write_sb()?;
        for l in dropped {
            self.remove_layer_files(l)?;
        }
        Ok(())
    }

    /// Ordered: grows the volume to `size_blocks` (shrinking is refused).
    pub fn resize(&mut self, tag: Tag, size_blocks: u64) -> Result<()> {
        if size_blocks < self.sb.size_blocks {
            return Err(Error::InvalidArgument(format!(
                "cannot shrink from {} to {} blocks",
                self.sb.size_blocks, size_blocks
            )));
        }
        self.checkpoint()?;
        self.grow(size_blocks)?;
        self.sb.size_blocks = size_blocks;
        self.position = tag;
        self.sb.position = tag;
        self.write_sb()
    }

    /// Ordered no-op that only advances the position (used for operations
    /// that change nothing on this replica).
    pub fn advance(&mut self, tag: Tag) -> Result<()> {
        self.checkpoint()?;
        self.position = tag;
        self.sb.position = tag;
        self.write_sb()
    }

    /// Whether the copies a crash would fall back to verify: for every block
    /// whose current copy is still only in the WAL, the copy in its layer
    /// files (metadata entry and data) that recovery would expose if the
    /// WAL record were lost. For the simulator's fault model (damage to a
    /// shadowed copy is invisible to reads until a power loss un-shadows
    /// it); reads the files, so not for the data path.
    pub fn fallback_copies_ok(&self) -> bool {
        let mut buf = vec![0u8; BLOCK_SIZE];
        let sealed = self.sealed.iter().flat_map(|s| s.dirty.iter());
        self.dirty.iter().chain(sealed).all(|(layer, lba)| {
            let Some(li) = self.layer_index(layer) else {
                return true;
            };
            let l = &self.layers[li];
            let mut raw = [0u8; META_SIZE];
            if l.meta.read_at(&mut raw, lba * META_SIZE as u64).is_err() {
                // Past the end of the meta file: no older copy.
                return l.meta.len().is_ok_and(|n| n <= lba * META_SIZE as u64);
            }
            match BlockMeta::decode(&raw) {
                Ok(None) => true,
                Ok(Some(m)) if m.is_damaged() => false,
                Ok(Some(m)) if m.is_zero() => true,
                Ok(Some(m)) if m.flags & META_EXTENT != 0 => {
                    let x = BlockMeta::extent_block(&raw).unwrap_or(0);
                    l.ext.as_ref().is_some_and(|f| {
                        f.read_at(&mut buf, u64::from(x) * BLOCK_SIZE_U64).is_ok()
                            && self.sb.checksum.block(lba, &buf) == m.crc
                    })
                }
                Ok(Some(m)) => {
                    l.data.read_at(&mut buf, lba * BLOCK_SIZE_U64).is_ok()
                        && self.sb.checksum.block(lba, &buf) == m.crc
                }
                Err(()) => false,
            }
        })
    }

    /// Debug description of a block's entry in a layer (for diagnostics).
    pub fn describe_block(&self, layer: u64, lba: u64) -> String {
        let Some(li) = self.layer_index(layer) else {
            return "no layer".into();
        };
        let e = self.layers[li].blocks.get(lba);
        let mut buf = vec![0u8; BLOCK_SIZE];
        let actual = e.map(|e| match e.loc {
            Loc::Layer => self.layers[li]
                .data
                .read_at(&mut buf, lba * BLOCK_SIZE_U64)
                .map(|_| self.sb.checksum.block(lba, &buf))
                .ok(),
            Loc::Wal(f, off) => self.wals[usize::from(f)]
                .read_at(&mut buf, off)
                .map(|_| self.sb.checksum.block(lba, &buf))
                .ok(),
            Loc::Ext(x) => self.layers[li].ext.as_ref().and_then(|f| {
                f.read_at(&mut buf, u64::from(x) * BLOCK_SIZE_U64)
                    .map(|_| self.sb.checksum.block(lba, &buf))
                    .ok()
            }),
            Loc::Damaged => None,
        });
        let rl = self
            .read_layer(layer, lba, 1, true)
            .ok()
            .and_then(|mut v| v.pop())
            .and_then(|(_, d)| d);
        let same = rl.as_deref() == Some(&buf[..]);
        format!(
            "{e:?} actual crc {actual:?} head {:?} read_layer same {same}",
            &buf[..16]
        )
    }

    /// Ids of the layers, bottom first.
    pub fn layer_ids(&self) -> Vec<u64> {
        self.layers.iter().map(|l| l.info.id).collect()
    }
}
