// SPDX-License-Identifier: Apache-2.0
//! The target side of a migration ([`VmBuilder::receive_migration`]):
//! builds the VM without booting it, writes received pages straight into
//! its guest RAM, loads the state, and starts only on the source's commit.

use std::net::TcpStream;

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::precopy::{proto, recv, tx};
use super::transport::{Role, SecureStream};
use super::wire::{self, MAX_STATE, Msg, PAGE};
use super::{MigrationConfig, MigrationError};
use crate::error::{Error, Result};
use crate::memory::GuestMemory;
use crate::vm::state::{SnapshotError, VmSnapshot};
use crate::vm::{Vm, VmBuilder};

static ZERO_PAGE: [u8; PAGE] = [0; PAGE];

impl VmBuilder {
    /// Receives a VM migrated by [`Vm::migrate`] over `stream` (accepted
    /// by the caller) and returns it running. The builder must describe
    /// the same machine as the source (vCPUs, RAM size, devices; disks
    /// reachable with the data the source flushed).
    ///
    /// The VM starts only after its RAM and complete state arrived and
    /// loaded and the source committed; any failure before that returns an
    /// error and leaves no VM.
    pub fn receive_migration(self, stream: TcpStream, cfg: &MigrationConfig) -> Result<Vm> {
        cfg.validate()?;
        let mut link = SecureStream::handshake(stream, &cfg.key, Role::Target, cfg.io_timeout)
            .map_err(|e| {
                tracing::warn!(error = %e, "incoming migration refused at the handshake");
                received_failed(tx(e))
            })?;
        let vm = match self.create_for_migration() {
            Ok(vm) => vm,
            Err(e) => {
                let _ = link.send(&wire::encode(&Msg::Abort(format!(
                    "the target cannot build the VM: {e}"
                ))));
                return Err(received_failed(e));
            }
        };
        match receive(&vm, &mut link, cfg) {
            Ok(()) => {
                tracing::info!(vm = %vm.name(), "migrated VM running here");
                Ok(vm)
            }
            Err(e) => {
                let _ = link.send(&wire::encode(&Msg::Abort(chain(&e))));
                link.shutdown();
                tracing::warn!(vm = %vm.name(), error = %e, "incoming migration failed; the VM was not started");
                drop(vm);
                Err(received_failed(e))
            }
        }
    }
}

impl Vm {
    /// [`VmBuilder::receive_migration`] for a config without run-time backends.
    pub fn receive_migration(
        config: crate::VmConfig,
        stream: TcpStream,
        cfg: &MigrationConfig,
    ) -> Result<Vm> {
        Vm::builder(config).receive_migration(stream, cfg)
    }
}

/// `e` and its causes, `: `-separated: what the source is told.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

fn received_failed(cause: Error) -> Error {
    MigrationError::ReceiveFailed {
        cause: Box::new(cause),
    }
    .into()
}

fn mismatch(what: &'static str, source: impl ToString, target: impl ToString) -> Error {
    proto(MigrationError::Mismatch {
        what,
        source_value: source.to_string(),
        target_value: target.to_string(),
    })
}

/// Writes one received page into guest RAM after checking its address.
fn write_page(mem: &GuestMemory, gpa: u64, data: Option<&[u8]>) -> Result<()> {
    let in_ram = gpa.is_multiple_of(PAGE as u64)
        && gpa.checked_add(PAGE as u64 - 1).is_some_and(|last| {
            mem.address_in_range(GuestAddress(gpa)) && mem.address_in_range(GuestAddress(last))
        });
    if !in_ram {
        return Err(proto(MigrationError::PageOutOfRange { gpa }));
    }
    mem.write_slice(data.unwrap_or(&ZERO_PAGE), GuestAddress(gpa))
        .map_err(|source| SnapshotError::GuestMemory { addr: gpa, source }.into())
}

fn receive(vm: &Vm, link: &mut SecureStream, cfg: &MigrationConfig) -> Result<()> {
    let mut buf = Vec::new();
    match recv(link, &mut buf)? {
        Msg::Hello {
            version,
            memory_bytes,
            vcpus,
        } => {
            if version != wire::VERSION {
                return Err(mismatch("protocol version", version, wire::VERSION));
            }
            if memory_bytes != vm.ram_size() {
                return Err(mismatch("RAM (bytes)", memory_bytes, vm.ram_size()));
            }
            if vcpus as usize != vm.vcpu_count() {
                return Err(mismatch("vCPU count", vcpus, vm.vcpu_count()));
            }
        }
        m => {
            return Err(proto(MigrationError::Protocol(format!(
                "got {} before Hello",
                m.name()
            ))));
        }
    }
    link.send(&wire::encode(&Msg::HelloAck)).map_err(tx)?;
    let mem = vm.guest_memory();
    let mut pass = 0u32;
    let mut in_pass = 0u64;
    let mut state = Vec::new();
    loop {
        match recv(link, &mut buf)? {
            Msg::Pages { pass: p, pages } => {
                if p != pass || !state.is_empty() {
                    return Err(proto(MigrationError::Protocol(format!(
                        "pages of pass {p} during pass {pass} or after the state"
                    ))));
                }
                for r in pages {
                    write_page(mem, r.gpa, r.data)?;
                    in_pass += 1;
                }
            }
            Msg::PassEnd { pass: p, pages } => {
                if p != pass || !state.is_empty() {
                    return Err(proto(MigrationError::Protocol(format!(
                        "end of pass {p} during pass {pass} or after the state"
                    ))));
                }
                if pages != in_pass {
                    return Err(proto(MigrationError::Protocol(format!(
                        "pass {p} announced {pages} pages but carried {in_pass}"
                    ))));
                }
                pass += 1;
                in_pass = 0;
            }
            Msg::StateChunk(b) => {
                if state.len() as u64 + b.len() as u64 > MAX_STATE {
                    return Err(proto(MigrationError::Protocol(format!(
                        "the state exceeds {MAX_STATE} bytes"
                    ))));
                }
                state.extend_from_slice(b);
            }
            Msg::StateEnd { total } => {
                if total != state.len() as u64 {
                    return Err(proto(MigrationError::Protocol(format!(
                        "the state announced {total} bytes but carried {}",
                        state.len()
                    ))));
                }
                break;
            }
            m => {
                return Err(proto(MigrationError::Protocol(format!(
                    "unexpected {} while receiving RAM and state",
                    m.name()
                ))));
            }
        }
    }
    let snap = VmSnapshot::from_json(&state)?;
    vm.load_migrated_state(&snap)?;
    link.send(&wire::encode(&Msg::Ready)).map_err(tx)?;
    match recv(link, &mut buf)? {
        Msg::Commit => {}
        m => {
            return Err(proto(MigrationError::Protocol(format!(
                "got {} while waiting for Commit",
                m.name()
            ))));
        }
    }
    if let Some(hook) = &cfg.before_start {
        hook().map_err(|m| Error::Migration(MigrationError::StartRefused(m)))?;
    }
    vm.start()?;
    // Committed: the source will not resume on its own, so the guest runs
    // here even if this confirmation is lost.
    if let Err(e) = link.send(&wire::encode(&Msg::Running)) {
        tracing::warn!(vm = %vm.name(), error = %e, "cannot confirm to the source that the VM runs; it stays paused there");
    }
    Ok(())
}
