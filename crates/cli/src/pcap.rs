//! `softrdma pcap ...`: capture checks.

use clap::Subcommand;
use std::path::PathBuf;
use std::process::ExitCode;

/// Subcommands of `softrdma pcap`.
#[derive(Subcommand)]
pub enum PcapCommand {
    /// Parse every RoCE packet of each capture and verify its ICRC.
    Check {
        /// Capture files (pcap).
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
}

/// Run a `pcap` subcommand.
pub fn run(cmd: PcapCommand) -> ExitCode {
    match cmd {
        PcapCommand::Check { files } => {
            eprintln!("not yet: {} files", files.len());
            ExitCode::FAILURE
        }
    }
}
