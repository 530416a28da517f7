//! Daemon mode: devices owned by `softrdmad` and shared by many processes.
//!
//! * [`server`]: the daemon itself ([`server::run`]).
//! * `client`: the application side behind the verbs types (a [`crate::Context`] opened on a
//!   daemon device holds a session; its objects are handles at the daemon, and posting and polling
//!   touch only rings in memory shared with it).
//! * [`admin`]: what the `softrdma` command line asks a running daemon (devices, links, counters).
//!
//! [`crate::open_device`] resolves a name to the daemon's device when a daemon runs and has it,
//! and to an embedded device otherwise; application code does not change.

pub mod admin;
pub(crate) mod client;
mod loop_wait;
pub mod server;
