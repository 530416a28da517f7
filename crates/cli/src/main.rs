//! `softrdma`: the multi-call command line of the project.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod demo;
mod devinfo;
mod pcap;
mod perf;
mod pingpong;

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
    /// Two embedded soft RoCE devices on loopback: every operation, checked, then bandwidth and latency.
    Demo(demo::DemoArgs),
    /// List the RDMA devices and their node GUIDs (like `ibv_devices`).
    Devices,
    /// Print device and port attributes (like `ibv_devinfo`).
    Devinfo(devinfo::DevinfoArgs),
    /// RC ping-pong between two hosts (like `ibv_rc_pingpong`; server without a host name).
    Pingpong(pingpong::PingpongArgs),
    /// Bandwidth and latency tests with perftest's flags and output (ib_write_bw, ib_send_lat, ...).
    Perf(perf::PerfArgs),
    /// Work with packet captures.
    Pcap {
        #[command(subcommand)]
        command: pcap::PcapCommand,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Demo(args) => demo::run(args),
        Command::Devices => devinfo::run_devices(),
        Command::Devinfo(args) => devinfo::run_devinfo(args),
        Command::Pcap { command } => pcap::run(command),
        Command::Perf(args) => perf::run(args),
        Command::Pingpong(args) => pingpong::run(args),
    }
}
