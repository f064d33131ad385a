// SPDX-License-Identifier: Apache-2.0
//! The 8250 UART on COM1 (vm-superio), its output sinks and the console ring.

use std::collections::VecDeque;
use std::fmt;
use std::fs::File;
use std::io::{self, Write};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use super::BusDevice;

/// An interrupt line backed by an irqfd.
#[derive(Debug)]
pub struct IrqTrigger(pub EventFd);

impl Trigger for IrqTrigger {
    type E = io::Error;
    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

/// An in-memory ring of the most recent console output, shared between the
/// serial device and readers. Positions are absolute byte counts since boot,
/// so a reader can tail with [`ConsoleRing::read_from`].
#[derive(Clone)]
pub struct ConsoleRing {
    inner: Arc<Mutex<RingInner>>,
}

struct RingInner {
    buf: VecDeque<u8>,
    cap: usize,
    total: u64,
}

impl fmt::Debug for ConsoleRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = self.lock();
        f.debug_struct("ConsoleRing")
            .field("cap", &g.cap)
            .field("total", &g.total)
            .finish()
    }
}

impl ConsoleRing {
    /// A ring keeping the last `cap` bytes.
    pub fn new(cap: usize) -> Self {
        ConsoleRing {
            inner: Arc::new(Mutex::new(RingInner {
                buf: VecDeque::with_capacity(cap.min(1 << 20)),
                cap,
                total: 0,
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RingInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends output.
    pub fn push(&self, data: &[u8]) {
        let mut g = self.lock();
        g.total += data.len() as u64;
        let cap = g.cap;
        let data = &data[data.len().saturating_sub(cap)..];
        let overflow = (g.buf.len() + data.len()).saturating_sub(cap);
        g.buf.drain(..overflow);
        g.buf.extend(data);
    }

    /// Everything currently held.
    pub fn contents(&self) -> Vec<u8> {
        self.lock().buf.iter().copied().collect()
    }

    /// Output since absolute position `pos` (clamped to what is still held)
    /// and the position to continue from.
    pub fn read_from(&self, pos: u64) -> (Vec<u8>, u64) {
        let g = self.lock();
        let start = g.total - g.buf.len() as u64;
        let from = pos.clamp(start, g.total);
        let skip = (from - start) as usize;
        (g.buf.iter().skip(skip).copied().collect(), g.total)
    }

    /// Total bytes written since boot.
    pub fn total(&self) -> u64 {
        self.lock().total
    }
}

/// A console output callback.
pub type SerialCallback = Box<dyn FnMut(&[u8]) + Send>;

/// Where console output goes besides the ring.
pub enum SerialSink {
    /// Nowhere.
    None,
    /// The process's stdout.
    Stdout,
    /// A file.
    File(File),
    /// Line-buffered chunks sent on a channel.
    Channel(Sender<Vec<u8>>),
    /// Line-buffered chunks passed to a callback.
    Callback(SerialCallback),
}

impl fmt::Debug for SerialSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SerialSink::None => "None",
            SerialSink::Stdout => "Stdout",
            SerialSink::File(_) => "File",
            SerialSink::Channel(_) => "Channel",
            SerialSink::Callback(_) => "Callback",
        })
    }
}

/// The serial device's writer: ring + sink, with line buffering for
/// channel and callback sinks.
#[derive(Debug)]
pub struct SerialOut {
    ring: ConsoleRing,
    sink: SerialSink,
    line: Vec<u8>,
}

impl SerialOut {
    /// A writer into `ring` and `sink`.
    pub fn new(ring: ConsoleRing, sink: SerialSink) -> Self {
        SerialOut {
            ring,
            sink,
            line: Vec::new(),
        }
    }

    fn emit(&mut self, data: &[u8]) {
        match &mut self.sink {
            SerialSink::None => {}
            SerialSink::Stdout => {
                // Unbuffered: prompts without a newline must show up too.
                let mut out = io::stdout().lock();
                let _ = out.write_all(data);
                let _ = out.flush();
            }
            SerialSink::File(f) => {
                let _ = f.write_all(data);
            }
            SerialSink::Channel(tx) => {
                let _ = tx.send(data.to_vec());
            }
            SerialSink::Callback(cb) => cb(data),
        }
    }

    /// Sends any partial line to the sink.
    pub fn flush_line(&mut self) {
        if !self.line.is_empty() {
            let l = std::mem::take(&mut self.line);
            self.emit(&l);
        }
    }
}

impl Write for SerialOut {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.ring.push(data);
        match self.sink {
            SerialSink::Channel(_) | SerialSink::Callback(_) => {
                self.line.extend_from_slice(data);
                if data.contains(&b'\n') || self.line.len() >= 1024 {
                    self.flush_line();
                }
            }
            _ => self.emit(data),
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if let SerialSink::Stdout = self.sink {
            io::stdout().flush()?;
        }
        Ok(())
    }
}

/// The UART's registers and input FIFO, for snapshots. Output is never
/// buffered in the device: a snapshot flushes any partial line to the sink.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialSnapshot {
    /// Divisor latch, low byte.
    pub baud_divisor_low: u8,
    /// Divisor latch, high byte.
    pub baud_divisor_high: u8,
    /// Interrupt enable register.
    pub interrupt_enable: u8,
    /// Interrupt identification register.
    pub interrupt_identification: u8,
    /// Line control register.
    pub line_control: u8,
    /// Line status register.
    pub line_status: u8,
    /// Modem control register.
    pub modem_control: u8,
    /// Modem status register.
    pub modem_status: u8,
    /// Scratch register.
    pub scratch: u8,
    /// Input bytes the guest has not read yet.
    pub in_buffer: Vec<u8>,
}

/// Bytes the UART's input FIFO holds (vm-superio's `FIFO_SIZE`).
const SERIAL_FIFO: usize = 64;

/// COM1.
pub struct SerialDevice {
    uart: Serial<IrqTrigger, NoEvents, SerialOut>,
}

impl fmt::Debug for SerialDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SerialDevice").finish_non_exhaustive()
    }
}

impl SerialDevice {
    /// A UART raising `irq` and writing to `out`.
    pub fn new(irq: EventFd, out: SerialOut) -> Self {
        SerialDevice {
            uart: Serial::new(IrqTrigger(irq), out),
        }
    }

    /// Queues input bytes for the guest; returns how many fit in the FIFO.
    pub fn enqueue_input(&mut self, data: &[u8]) -> usize {
        self.uart.enqueue_raw_bytes(data).unwrap_or(0)
    }

    /// The UART's state; flushes a partial output line to the sink first.
    pub fn save_state(&mut self) -> SerialSnapshot {
        self.flush();
        let s = self.uart.state();
        SerialSnapshot {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }

    /// Loads a saved UART state, keeping this device's interrupt line and
    /// output; raises the interrupt if the state has one pending.
    pub fn restore_state(&mut self, s: &SerialSnapshot) -> Result<(), String> {
        // Checked here so that a refused state leaves the device as it was.
        if s.in_buffer.len() > SERIAL_FIFO {
            return Err(format!(
                "the serial input FIFO holds {} bytes, more than {SERIAL_FIFO}",
                s.in_buffer.len()
            ));
        }
        let state = SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        };
        let irq = self
            .uart
            .interrupt_evt()
            .0
            .try_clone()
            .map_err(|e| format!("cannot clone the serial irqfd: {e}"))?;
        let out = std::mem::replace(
            self.uart.writer_mut(),
            SerialOut::new(ConsoleRing::new(0), SerialSink::None),
        );
        match Serial::from_state(&state, IrqTrigger(irq), NoEvents, out) {
            Ok(uart) => {
                self.uart = uart;
                Ok(())
            }
            // Only raising the interrupt can fail now.
            Err(e) => Err(format!("cannot raise the serial interrupt: {e:?}")),
        }
    }

    /// Flushes a partial line to the sink (at VM stop).
    pub fn flush(&mut self) {
        self.uart.writer_mut().flush_line();
        let _ = self.uart.writer_mut().flush();
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if data.len() == 1 && offset < 8 {
            data[0] = self.uart.read(offset as u8);
        } else {
            data.fill(0xff);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.len() == 1
            && offset < 8
            && let Err(e) = self.uart.write(offset as u8, data[0])
        {
            tracing::debug!(error = ?e, "serial write failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_keeps_tail_and_supports_tailing() {
        let r = ConsoleRing::new(8);
        r.push(b"hello ");
        let (d, pos) = r.read_from(0);
        assert_eq!(d, b"hello ");
        r.push(b"world!");
        assert_eq!(r.contents(), b"o world!");
        let (d, pos2) = r.read_from(pos);
        assert_eq!(d, b"world!");
        assert_eq!(pos2, 12);
        // A position that fell out of the ring is clamped.
        assert_eq!(r.read_from(0).0, b"o world!");
        r.push(&[b'x'; 20]);
        assert_eq!(r.contents(), vec![b'x'; 8]);
    }

    #[test]
    fn channel_sink_is_line_buffered() {
        let (tx, rx) = std::sync::mpsc::channel();
        let ring = ConsoleRing::new(64);
        let mut out = SerialOut::new(ring.clone(), SerialSink::Channel(tx));
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut dev = SerialDevice::new(irq, out_take(&mut out));
        for b in b"ab\ncd" {
            dev.write(0, &[*b]);
        }
        assert_eq!(rx.try_recv().unwrap(), b"ab\n");
        assert!(rx.try_recv().is_err());
        dev.flush();
        assert_eq!(rx.try_recv().unwrap(), b"cd");
        assert_eq!(ring.contents(), b"ab\ncd");
    }

    fn out_take(o: &mut SerialOut) -> SerialOut {
        std::mem::replace(o, SerialOut::new(ConsoleRing::new(1), SerialSink::None))
    }
}
