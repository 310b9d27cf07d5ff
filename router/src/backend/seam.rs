//! The calls the router makes to its nodes, behind two traits: what a prefill node answers
//! ([`PrefillCalls`]) and what a decode node answers ([`DecodeCalls`]). The gRPC clients
//! implement them ([`GrpcPrefill`], [`GrpcDecode`]); the unit tests' scripted nodes
//! (`fake.rs`) do too, so that a route, a switch or a fallback runs without processes.
//!
//! A call answers as its gRPC method does: the node's refusal is a [`tonic::Status`]
//! (whose details carry the node's `ErrorCode`), a streamed answer an [`Events`] stream of
//! the node's messages, each of which may be an error too.

use std::pin::Pin;

use edgesplit_proto::auth::GrpcCredentials;
use edgesplit_proto::pb;
use edgesplit_proto::pb::decode_client::DecodeClient;
use edgesplit_proto::pb::prefill_client::PrefillClient;
use futures::future::BoxFuture;
use futures::{Stream, StreamExt};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::Status;

/// A node's streamed answer: its messages in order, or the error that ends it.
pub type Events<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// A call to a node, answered by the node or refused with a status.
pub type Call<'a, T> = BoxFuture<'a, Result<T, Status>>;

/// The next message of `stream`: `None` once it ended.
///
/// # Errors
/// The status the node ended the stream with.
pub async fn message<T>(stream: &mut Events<T>) -> Result<Option<T>, Status> {
    stream.next().await.transpose()
}

/// What the router asks of a prefill node.
pub trait PrefillCalls: Send + Sync {
    /// A split request's prefill, its state handed to the decode node the request names:
    /// the first token, then the handoff's report (after) or the answer's tokens until the
    /// switch (live).
    fn prefill(&self, req: pb::PrefillRequest) -> Call<'_, Events<pb::PrefillEvent>>;
    /// A colocated answer (or a resumed one: `resume_tokens`): its prefill report, tokens
    /// and end.
    fn generate(&self, req: pb::PrefillRequest) -> Call<'_, Events<pb::TokenEvent>>;
    /// The node's identity, settings and state.
    fn info(&self) -> Call<'_, pb::NodeInfo>;
}

/// What the router asks of a decode node.
pub trait DecodeCalls: Send + Sync {
    /// The rest of a split answer, from the state the prefill node handed over.
    fn generate(&self, req: pb::GenerateRequest) -> Call<'_, Events<pb::TokenEvent>>;
    /// A whole answer on this node (the decode node alone, a conversation's next turn).
    fn local(&self, req: pb::PrefillRequest) -> Call<'_, Events<pb::TokenEvent>>;
    /// The node's identity, settings, handoff addresses and KV budget.
    fn info(&self) -> Call<'_, pb::NodeInfo>;
}

/// A node channel that adds the shared-secret credential to every call.
type Authed = InterceptedService<Channel, GrpcCredentials>;

fn boxed<T: Send + 'static>(s: tonic::Streaming<T>) -> Events<T> {
    Box::pin(s)
}

/// A prefill node over gRPC.
#[derive(Clone)]
pub struct GrpcPrefill(PrefillClient<Authed>);

/// A decode node over gRPC.
#[derive(Clone)]
pub struct GrpcDecode(DecodeClient<Authed>);

impl GrpcPrefill {
    /// A lazily connected client of `channel`, each call carrying `credentials`.
    #[must_use]
    pub fn new(channel: Channel, credentials: GrpcCredentials) -> Self {
        Self(PrefillClient::with_interceptor(channel, credentials))
    }
}

impl GrpcDecode {
    /// A lazily connected client of `channel`, each call carrying `credentials`.
    #[must_use]
    pub fn new(channel: Channel, credentials: GrpcCredentials) -> Self {
        Self(DecodeClient::with_interceptor(channel, credentials))
    }
}

impl PrefillCalls for GrpcPrefill {
    fn prefill(&self, req: pb::PrefillRequest) -> Call<'_, Events<pb::PrefillEvent>> {
        let mut c = self.0.clone();
        Box::pin(async move { Ok(boxed(c.prefill(req).await?.into_inner())) })
    }

    fn generate(&self, req: pb::PrefillRequest) -> Call<'_, Events<pb::TokenEvent>> {
        let mut c = self.0.clone();
        Box::pin(async move { Ok(boxed(c.generate(req).await?.into_inner())) })
    }

    fn info(&self) -> Call<'_, pb::NodeInfo> {
        let mut c = self.0.clone();
        Box::pin(async move { Ok(c.info(pb::InfoRequest {}).await?.into_inner()) })
    }
}

impl DecodeCalls for GrpcDecode {
    fn generate(&self, req: pb::GenerateRequest) -> Call<'_, Events<pb::TokenEvent>> {
        let mut c = self.0.clone();
        Box::pin(async move { Ok(boxed(c.generate(req).await?.into_inner())) })
    }

    fn local(&self, req: pb::PrefillRequest) -> Call<'_, Events<pb::TokenEvent>> {
        let mut c = self.0.clone();
        Box::pin(async move { Ok(boxed(c.local(req).await?.into_inner())) })
    }

    fn info(&self) -> Call<'_, pb::NodeInfo> {
        let mut c = self.0.clone();
        Box::pin(async move { Ok(c.info(pb::InfoRequest {}).await?.into_inner()) })
    }
}
