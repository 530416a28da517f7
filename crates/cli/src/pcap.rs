//! `softrdma pcap ...`: capture checks.
//!
//! `softrdma pcap check FILE...` prints one line per readable file,
//!
//! ```text
//! FILE: N packets, N roce, N icrc-ok, N icrc-bad, N malformed
//! ```
//!
//! where `packets` counts every record, `roce` the frames classified as RoCE (UDP port 4791, or
//! EtherType 0x8915), `icrc-ok`/`icrc-bad` the RoCE packets that parse and whose ICRC does or does
//! not match, and `malformed` the RoCE frames that do not parse — headers, and for datagrams to QP0/QP1
//! the MAD, and a CM MAD's message (plus a record cut off by the end of
//! the file). Frames that are not RoCE count only in `packets`. Details of each bad or malformed
//! packet go to stderr, as does the reason a file cannot be read at all (that file gets no counts
//! line). The exit status is non-zero if any file cannot be read or has a bad or malformed packet.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Subcommand;
use softrdma_wire::capture::{classify, Classified, PcapReader};
use softrdma_wire::cm::CmMessage;
use softrdma_wire::mad::{MadHeader, MadPacket, CLASS_CM};
use softrdma_wire::roce::{RoceV1Packet, RoceV2Packet};
use softrdma_wire::IbPacket;

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
            let mut ok = true;
            for f in &files {
                ok &= check_file(f);
            }
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// Per-file counters.
#[derive(Debug, Default)]
struct Counts {
    packets: u64,
    roce: u64,
    icrc_ok: u64,
    icrc_bad: u64,
    malformed: u64,
}

/// How many per-packet complaints to print per file.
const MAX_DETAILS: u64 = 10;

/// Check one file; print its line; return whether it is clean.
fn check_file(path: &Path) -> bool {
    let name = path.display();
    let data = match std::fs::read(path) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("softrdma: {name}: cannot read: {e}");
            return false;
        }
    };
    let reader = match PcapReader::new(&data) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("softrdma: {name}: {e}");
            return false;
        }
    };
    let link = reader.link_type();
    let mut c = Counts::default();
    let complain = |c: &Counts, what: String| {
        if c.icrc_bad + c.malformed <= MAX_DETAILS {
            eprintln!("softrdma: {name}: frame {}: {what}", c.packets);
        }
    };
    for rec in reader {
        c.packets += 1;
        let frame = match rec {
            Ok(f) => f,
            Err(e) => {
                c.malformed += 1;
                complain(&c, e.to_string());
                break;
            }
        };
        let verdict = match classify(link, frame.data) {
            Classified::NotRoce => continue,
            Classified::RoceV2(ip) => RoceV2Packet::parse(ip).and_then(|p| {
                check_mad(p.ib())?;
                Ok((p.icrc_ok(), p.ib().icrc(), p.computed_icrc()))
            }),
            Classified::RoceV1(grh) => RoceV1Packet::parse(grh).and_then(|p| {
                check_mad(p.ib())?;
                Ok((p.icrc_ok(), p.ib().icrc(), p.computed_icrc()))
            }),
        };
        c.roce += 1;
        match verdict {
            Ok((true, _, _)) => c.icrc_ok += 1,
            Ok((false, carried, computed)) => {
                c.icrc_bad += 1;
                complain(&c, format!("bad ICRC: carried {carried:#010x}, computed {computed:#010x}"));
            }
            Err(e) => {
                c.malformed += 1;
                complain(&c, format!("malformed RoCE packet: {e}"));
            }
        }
    }
    println!(
        "{name}: {} packets, {} roce, {} icrc-ok, {} icrc-bad, {} malformed",
        c.packets, c.roce, c.icrc_ok, c.icrc_bad, c.malformed
    );
    c.icrc_bad == 0 && c.malformed == 0
}

/// A datagram to QP0/QP1 carries a MAD; a CM MAD must decode as its CM message.
fn check_mad(ib: &IbPacket<&[u8]>) -> Result<(), softrdma_wire::Error> {
    if ib.deth().is_none() || ib.bth().dest_qp().value() > 1 {
        return Ok(());
    }
    let mad = ib.payload();
    let header = MadHeader::parse(&MadPacket::new_checked(mad)?)?;
    if header.mgmt_class == CLASS_CM {
        CmMessage::parse(mad)?;
    }
    Ok(())
}
