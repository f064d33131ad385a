// SPDX-License-Identifier: Apache-2.0
//! A KVM virtual machine monitor as an embeddable library, built on rust-vmm.
#![warn(missing_docs)]
