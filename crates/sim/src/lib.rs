//! A deterministic simulator for the transport engine: nodes (an [`Hca`] plus simulated registered
//! memory) joined by a network with seeded loss, duplication, reordering, corruption and delay, all
//! in virtual time. Tests drive it step by step or run it until a condition holds.
#![forbid(unsafe_code)]

pub mod memory;
pub mod net;
pub mod pair;
pub mod replay;
pub mod rng;
pub mod steps;
pub mod workload;

pub use memory::SimMemory;
pub use net::{Captured, Fate, Impairments, Net, NodeId};
pub use pair::{ConnOpts, Endpoint};
pub use rng::Rng;
