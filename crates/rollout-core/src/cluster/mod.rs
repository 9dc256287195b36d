//! The controller's half of a distributed run: the generation pool ([`pool`]) that leases
//! prompt groups to remote workers and journals them ([`ledger`]), the remote trainer ranks
//! ([`remote`]), and weight versions cut into checksummed buckets, served and relayed
//! ([`weights`]), from a trainer's tensors in place where it can ([`in_place`]). The processes on the other end live in the `rollout` binary.

mod assemble;
pub mod buckets;
pub mod in_place;
pub mod ledger;
pub mod pool;
pub mod remote;
pub mod weights;
