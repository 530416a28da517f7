//! `softrdma`: the multi-call command line of the project.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod demo;
mod devinfo;
mod exchange;
mod pcap;
mod perf;
mod pingpong;
mod service;

#[derive(Parser)]
#[command(name = "softrdma", version, about = "RDMA and InfiniBand in user space")]
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
    /// Run softrdmad: own the devices and serve every process on this host.
    Daemon(service::DaemonArgs),
    /// Show, add and delete devices (like `rdma link`).
    Link {
        #[command(subcommand)]
        command: Option<service::LinkCommand>,
    },
    /// Device settings (like `rdma dev set NAME name NEWNAME`).
    Dev {
        #[command(subcommand)]
        command: service::DevCommand,
    },
    /// Show or set the default RoCE mode of a port (v1 or v2).
    RoceMode(service::RoceModeArgs),
    /// Port state (like `ibstat`), or with --counters the daemon's counters.
    Stat(service::StatArgs),
}

fn main() -> ExitCode {
    // Installed (or linked) as `softrdmad`, the binary is the daemon.
    let argv0 = std::env::args_os().next().unwrap_or_default();
    if std::path::Path::new(&argv0).file_name().is_some_and(|n| n == "softrdmad") {
        #[derive(Parser)]
        #[command(name = "softrdmad", version, about = "softrdma's device daemon")]
        struct Softrdmad {
            #[command(flatten)]
            args: service::DaemonArgs,
        }
        return service::run_daemon(Softrdmad::parse().args);
    }
    let cli = Cli::parse();
    match cli.command {
        Command::Demo(args) => demo::run(args),
        Command::Devices => devinfo::run_devices(),
        Command::Devinfo(args) => devinfo::run_devinfo(args),
        Command::Pcap { command } => pcap::run(command),
        Command::Perf(args) => perf::run(args),
        Command::Pingpong(args) => pingpong::run(args),
        Command::Daemon(args) => service::run_daemon(args),
        Command::Link { command } => service::run_link(command),
        Command::Dev { command } => service::run_dev(command),
        Command::RoceMode(args) => service::run_roce_mode(args),
        Command::Stat(args) => service::run_stat(args),
    }
}
