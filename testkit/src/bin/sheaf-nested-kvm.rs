// SPDX-License-Identifier: Apache-2.0
//! `sheaf-nested-kvm`: runs a static program inside the nested-KVM box
//! (called by `scripts/nested-kvm`). Exits with the program's status.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use sheaf_testkit::nested::{BoxEvent, BoxPhase, NestedBox};

/// Run a statically linked program in the nested-KVM box: QEMU TCG with an
/// emulated AMD SVM CPU boots the Debian cloud kernel, loads kvm_amd, and
/// runs PROGRAM in /box with a real /dev/kvm.
#[derive(Debug, Parser)]
#[command(name = "sheaf-nested-kvm")]
struct Args {
    /// Put a host file in /box as NAME (NAME=PATH, repeatable).
    #[arg(long, value_name = "NAME=PATH")]
    file: Vec<String>,
    /// Copy /box/NAME back out after the program exits (repeatable).
    #[arg(long, value_name = "NAME")]
    collect: Vec<String>,
    /// Where to put the files that come back (collected ones and out/*).
    #[arg(long, value_name = "DIR")]
    out_dir: Option<PathBuf>,
    /// Environment variable for the program (KEY=VALUE, repeatable).
    #[arg(long, value_name = "KEY=VALUE")]
    env: Vec<String>,
    /// L1 memory in MiB.
    #[arg(long, default_value_t = 2048)]
    memory: u32,
    /// Timeout for the whole run in seconds.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Do not fail when /dev/kvm is missing in L1.
    #[arg(long)]
    no_require_kvm: bool,
    /// Echo L1's serial console as it arrives.
    #[arg(long, short)]
    verbose: bool,
    /// The static program to run.
    program: PathBuf,
    /// Its arguments (everything after PROGRAM, dashes included).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

fn main() -> ExitCode {
    sheaf_testkit::init_tracing();
    match run(Args::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("nested-kvm: error: {e:#}");
            ExitCode::from(125)
        }
    }
}

fn split(kv: &str, what: &str) -> anyhow::Result<(String, String)> {
    let (k, v) = kv
        .split_once('=')
        .ok_or_else(|| anyhow::anyhow!("{what} must be KEY=VALUE, got {kv:?}"))?;
    Ok((k.to_string(), v.to_string()))
}

fn run(args: Args) -> anyhow::Result<ExitCode> {
    let mut b = NestedBox::new()
        .memory_mib(args.memory)
        .timeout(Duration::from_secs(args.timeout))
        .require_kvm(!args.no_require_kvm);
    for f in &args.file {
        let (name, path) = split(f, "--file")?;
        b = b.file(&name, path);
    }
    for c in &args.collect {
        b = b.collect(c);
    }
    for e in &args.env {
        let (k, v) = split(e, "--env")?;
        b = b.env(&k, &v);
    }
    let verbose = args.verbose;
    let out = b.run_with_events(&args.program, &args.args, &mut |ev| match ev {
        BoxEvent::Console(line) if verbose => {
            eprintln!("[{:6.2}] {}", line.at.as_secs_f64(), line.text)
        }
        BoxEvent::Phase { phase, at } if !verbose => {
            let what = match phase {
                BoxPhase::Started => "qemu started",
                BoxPhase::L1Init => "L1 init",
                BoxPhase::KvmReady => "/dev/kvm ready",
                BoxPhase::ProgramStarted => "program started",
                BoxPhase::ProgramExited(_) => "program exited",
                BoxPhase::FilesOut => "output files written",
                _ => "phase",
            };
            eprintln!("nested-kvm: [{:6.2} s] {what}", at.as_secs_f64());
        }
        _ => {}
    })?;
    if !verbose {
        print!("{}", out.output);
    }
    if let Some(dir) = &args.out_dir {
        std::fs::create_dir_all(dir)?;
        copy_tree(out.files_dir(), dir)?;
        eprintln!("nested-kvm: files copied to {}", dir.display());
    }
    let t = out.timings;
    eprintln!(
        "nested-kvm: exit status {}; program started {:.1} s after qemu, ran {:.1} s; total {:.1} s",
        out.exit_status,
        t.program_start.as_secs_f64(),
        t.program_runtime().as_secs_f64(),
        t.total.as_secs_f64()
    );
    Ok(ExitCode::from(u8::try_from(out.exit_status).unwrap_or(1)))
}

fn copy_tree(from: &std::path::Path, to: &std::path::Path) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            std::fs::create_dir_all(&target)?;
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}
