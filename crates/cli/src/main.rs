//! `softrdma`: the multi-call command line of the project.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod pcap;

#[derive(Parser)]
#[command(
    name = "softrdma",
    version,
    about = "RDMA and InfiniBand in user space"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Work with packet captures.
    Pcap {
        #[command(subcommand)]
        command: pcap::PcapCommand,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Pcap { command } => pcap::run(command),
    }
}
