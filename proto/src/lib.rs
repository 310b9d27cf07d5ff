//! EdgeSplit wire formats.
//!
//! - [`pb`]: the gRPC control plane (router <-> nodes), generated from `proto/edgesplit.proto`.
//! - [`frame`], [`codec`], [`handoff`]: the V2 KV handoff over raw TCP (see `PROTOCOL.md`).
//! - [`error`]: the one error vocabulary ([`error::ErrorCode`]) every node and the router share.
//! - [`layout`]: llama.cpp's raw sequence-state layout, read into tensor descriptors.
//! - [`sampling`]: a request's sampling settings, one type from the router to the engine.

pub mod auth;
pub mod buffers;
pub mod codec;
pub mod error;
pub mod frame;
pub mod handoff;
pub mod join;
pub mod layout;
pub mod link;
pub mod metrics;
pub mod sampling;
pub mod service;
pub mod splice;
pub mod v1;

/// Generated gRPC types and services.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod pb {
    tonic::include_proto!("edgesplit.v1");
}
