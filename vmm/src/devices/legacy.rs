// SPDX-License-Identifier: Apache-2.0
//! Small port-I/O devices that end the VM: the i8042 reset line, a debug-exit
//! port, and the hardware-reduced ACPI sleep/reset register.

use std::sync::{Arc, Mutex};

use super::{Bus, BusDevice, SharedDevice};
use crate::acpi::{RESET_VALUE, S5_SLEEP_VALUE};
use crate::arch::x86_64::layout;
use crate::exit::{ExitLatch, ExitReason};

/// Puts the guest's port-I/O devices on `pio`: `serial` as COM1, the
/// i8042, the debug-exit port and the ACPI sleep/reset register, the last
/// three latching `exit`.
pub fn insert_pio_devices(pio: &mut Bus, serial: SharedDevice, exit: &ExitLatch) {
    pio.insert(u64::from(layout::COM1_PORT), 8, serial);
    pio.insert(
        u64::from(layout::I8042_PORT),
        5,
        Arc::new(Mutex::new(I8042::new(exit.clone()))),
    );
    pio.insert(
        u64::from(layout::DEBUG_EXIT_PORT),
        4,
        Arc::new(Mutex::new(DebugExit::new(exit.clone()))),
    );
    pio.insert(
        u64::from(layout::ACPI_PM_PORT),
        1,
        Arc::new(Mutex::new(AcpiPm::new(exit.clone()))),
    );
}

/// The i8042 keyboard controller, reduced to what guests use to reboot:
/// writing `0xfe` (pulse reset line) to the command port.
#[derive(Debug)]
pub struct I8042 {
    exit: ExitLatch,
}

impl I8042 {
    /// A controller that requests [`ExitReason::Reset`] on `0xfe`.
    pub fn new(exit: ExitLatch) -> Self {
        I8042 { exit }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        // Status: output buffer empty, input buffer empty; data: 0.
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset == 4 && data.first() == Some(&0xfe) {
            self.exit.request(ExitReason::Reset);
        }
    }
}

/// A debug-exit port: a write of 1, 2 or 4 bytes ends the VM with
/// [`ExitReason::DebugExit`] carrying the value written (QEMU's
/// `isa-debug-exit` reports `(value << 1) | 1` as its process status).
#[derive(Debug)]
pub struct DebugExit {
    exit: ExitLatch,
}

impl DebugExit {
    /// A port that latches `exit`.
    pub fn new(exit: ExitLatch) -> Self {
        DebugExit { exit }
    }
}

impl BusDevice for DebugExit {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0xff);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset != 0 || data.is_empty() || data.len() > 4 {
            return;
        }
        let mut b = [0u8; 4];
        b[..data.len()].copy_from_slice(data);
        self.exit.request(ExitReason::DebugExit {
            code: u32::from_le_bytes(b),
        });
    }
}

/// The ACPI sleep control/status and reset register (one byte).
#[derive(Debug)]
pub struct AcpiPm {
    exit: ExitLatch,
}

impl AcpiPm {
    /// A register that latches `exit` on S5 or reset.
    pub fn new(exit: ExitLatch) -> Self {
        AcpiPm { exit }
    }
}

impl BusDevice for AcpiPm {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        // Sleep status: WAK_STS clear.
        data.fill(0);
    }

    fn write(&mut self, _offset: u64, data: &[u8]) {
        match data.first() {
            Some(&v) if v == S5_SLEEP_VALUE => self.exit.request(ExitReason::Shutdown),
            Some(&v) if v == RESET_VALUE => self.exit.request(ExitReason::Reset),
            Some(&v) => tracing::debug!(value = v, "ignored ACPI sleep/reset write"),
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_map_to_exit_reasons() {
        let l = ExitLatch::new().unwrap();
        AcpiPm::new(l.clone()).write(0, &[0x00]);
        assert!(!l.is_set());
        AcpiPm::new(l.clone()).write(0, &[S5_SLEEP_VALUE]);
        assert_eq!(l.reason(), Some(ExitReason::Shutdown));

        let l = ExitLatch::new().unwrap();
        let mut k = I8042::new(l.clone());
        k.write(0, &[0xfe]);
        assert!(!l.is_set());
        k.write(4, &[0xfe]);
        assert_eq!(l.reason(), Some(ExitReason::Reset));

        let l = ExitLatch::new().unwrap();
        let mut d = DebugExit::new(l.clone());
        d.write(0, &[0; 8]);
        assert!(!l.is_set());
        d.write(0, &[0x34, 0x12]);
        assert_eq!(l.reason(), Some(ExitReason::DebugExit { code: 0x1234 }));
    }
}
