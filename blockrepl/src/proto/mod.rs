// SPDX-License-Identifier: Apache-2.0
//! The replication protocol, sans I/O: messages, the replica rules and the
//! engine state machine. Nothing here touches a socket or a clock; the
//! replica touches storage only through the [`crate::store::disk`] traits.

pub mod engine;
pub mod msg;
pub mod replica;
