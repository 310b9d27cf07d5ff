//! What the router knows of the nodes: their last `Info` answers and their refresh, and
//! what it learns from answers (conversations held, measured rates) to place the next ones.

use edgesplit_proto::link::HandshakeFailed;
use edgesplit_proto::pb;

use super::Failure;
use super::{Backend, PrefilledOn};
use crate::api::{Input, Transport};
use crate::placement::{Conversations, Rates};

/// What the router learns from answers to place the next ones (`placement.rs`).
#[derive(Debug, Default)]
pub(super) struct Learned {
    pub(super) conversations: Conversations,
    pub(super) rates: Rates,
    /// When each probe last started (`probe.rs`, by `Probe` index).
    pub(super) probed: [Option<std::time::Instant>; 3],
    /// When the last `auto` request came (the router is in use: `probe.rs`).
    pub(super) last_auto: Option<std::time::Instant>,
}

/// Both nodes' `Info` answers, prefill first.
pub type HealthInfos = (Result<pb::NodeInfo, Failure>, Result<pb::NodeInfo, Failure>);

/// Keeps a node's `Info` answer as its last known one; passes the call's result on.
fn remember(
    last: &std::sync::Mutex<Option<pb::NodeInfo>>,
    info: Result<pb::NodeInfo, Failure>,
) -> Result<pb::NodeInfo, Failure> {
    if let Ok(i) = &info {
        *lock_info(last) = Some(i.clone());
    }
    info
}

pub(super) fn lock_info(
    l: &std::sync::Mutex<Option<pb::NodeInfo>>,
) -> std::sync::MutexGuard<'_, Option<pb::NodeInfo>> {
    l.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub(super) fn lock(l: &std::sync::Mutex<Learned>) -> std::sync::MutexGuard<'_, Learned> {
    // A poisoned lock holds nothing an invariant depends on.
    l.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Backend {
    /// KV bytes per token of the model, as the decode node's last `Info` said (else the
    /// prefill node's; 0 before either answered): what the cost model's crossing and a
    /// split's expected work read.
    pub(super) fn kv_bytes_per_token(&self) -> u64 {
        lock_info(&self.last_decode_info)
            .as_ref()
            .or(lock_info(&self.last_prefill_info).as_ref())
            .map_or(0, |i| i.kv_bytes_per_token)
    }

    /// What records the length of an answer whose request set no `max_tokens` once it has
    /// ended, for the cost model to expect of the next such request
    /// ([`crate::placement::Rates::expected_answer`]).
    #[must_use]
    pub fn answer_length_meter(&self) -> Box<dyn FnOnce(u32) + Send> {
        let learned = self.learned.clone();
        Box::new(move |tokens| lock(&learned).rates.answered(tokens))
    }

    /// The prefill node's gRPC URL.
    #[must_use]
    pub fn prefill_url(&self) -> String {
        self.config.prefill_url.clone()
    }

    /// The decode node's gRPC URL.
    #[must_use]
    pub fn decode_url(&self) -> String {
        self.config.decode_url.clone()
    }

    /// The prefill node's info, within the info timeout.
    ///
    /// # Errors
    /// 503 when the node does not answer in time.
    pub async fn prefill_info(&self) -> Result<pb::NodeInfo, Failure> {
        let mut c = self.prefill.clone();
        let info = self
            .info_within(
                c.info(pb::InfoRequest {}),
                "prefill_unavailable",
                "the prefill node",
            )
            .await;
        if info.is_ok() {
            *self
                .prefill_info_at
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) =
                Some(std::time::Instant::now());
        }
        remember(&self.last_prefill_info, info)
    }

    /// The prefill node's `Info` for a request: the last answer while it is younger than
    /// `max_age` (no call on the request's path), else asked now.
    pub async fn prefill_info_fresh(
        &self,
        max_age: std::time::Duration,
    ) -> Result<pb::NodeInfo, Failure> {
        let at = *self
            .prefill_info_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if at.is_some_and(|at| at.elapsed() < max_age) {
            if let Some(i) = lock_info(&self.last_prefill_info).clone() {
                return Ok(i);
            }
        }
        self.prefill_info().await
    }

    /// The CPU architectures of the nodes that took part in an answer, from their last
    /// `Info` (`Timing::prefill_arch`, `decode_arch`): the prefill node's unless the
    /// decode node prefilled; the decode node's when the state crosses to it or it
    /// prefilled. Unknown (never answered `Info`) or not taking part: `None`.
    #[must_use]
    pub fn archs(
        &self,
        transport: Transport,
        placement: PrefilledOn,
    ) -> (Option<String>, Option<String>) {
        let arch = |l: &std::sync::Mutex<Option<pb::NodeInfo>>| {
            lock_info(l)
                .as_ref()
                .map(|i| i.arch.clone())
                .filter(|a| !a.is_empty())
        };
        let on_decode = placement == PrefilledOn::DecodeNode;
        let prefill = (!on_decode)
            .then(|| arch(&self.last_prefill_info))
            .flatten();
        let decode = (on_decode || matches!(transport, Transport::V1 | Transport::V2))
            .then(|| arch(&self.last_decode_info))
            .flatten();
        (prefill, decode)
    }

    /// When both nodes took part in an answer (the state crossed, or the decode node
    /// continued a conversation the prefill node began): whether they compute with the same
    /// numerics, from their last `Info`: the same CPU architecture and kernels (the build id
    /// is equal, or the handshake refused the state; the thread counts change nothing).
    /// `Some(false)`: the answer may part from either device's own after a rounding
    /// difference (PROTOCOL.md, "Compatibility"). `None`: one node, or an `Info` not known.
    #[must_use]
    pub fn same_numerics(&self, transport: Transport, placement: PrefilledOn) -> Option<bool> {
        if placement == PrefilledOn::DecodeNode
            || !matches!(transport, Transport::V1 | Transport::V2)
        {
            return None;
        }
        let numerics = |l: &std::sync::Mutex<Option<pb::NodeInfo>>| {
            lock_info(l)
                .as_ref()
                .filter(|i| !i.arch.is_empty())
                .map(|i| (i.arch.clone(), i.kernels.clone()))
        };
        let prefill = numerics(&self.last_prefill_info)?;
        let decode = numerics(&self.last_decode_info)?;
        Some(prefill == decode)
    }

    /// Whether the decode node renders `input` as the prefill node does: a raw prompt
    /// always; a chat when both nodes' last `Info` name the same chat template (another
    /// template is another prompt, and the decode node renders the chats it continues).
    pub(super) fn renders_alike(&self, input: &Input) -> bool {
        if matches!(input, Input::Prompt(_)) {
            return true;
        }
        let template = |l: &std::sync::Mutex<Option<pb::NodeInfo>>| {
            lock_info(l)
                .as_ref()
                .map(|i| i.chat_template_fingerprint.clone())
                .filter(|f| !f.is_empty())
        };
        let prefill = template(&self.last_prefill_info);
        prefill.is_some() && prefill == template(&self.last_decode_info)
    }

    /// Both nodes' `Info` (`/health`): the last answers while they are younger than
    /// `max_age`, else asked again - by one caller, the others waiting for its answers - so
    /// that hits cost each node at most one `Info` per `max_age`.
    pub async fn infos_within(&self, max_age: std::time::Duration) -> HealthInfos {
        let mut last = self.health_infos.lock().await;
        if let Some((at, infos)) = &*last {
            if at.elapsed() < max_age {
                return infos.clone();
            }
        }
        let infos = tokio::join!(self.prefill_info(), self.decode_info());
        *last = Some((std::time::Instant::now(), infos.clone()));
        infos
    }

    /// The decode node's info, within the info timeout.
    ///
    /// # Errors
    /// 503 when the node does not answer in time.
    pub async fn decode_info(&self) -> Result<pb::NodeInfo, Failure> {
        let mut c = self.decode.clone();
        let asked = std::time::Instant::now();
        let info = self
            .info_within(
                c.info(pb::InfoRequest {}),
                "decode_unavailable",
                "the decode node",
            )
            .await;
        if info.is_ok() {
            let ms = asked.elapsed().as_secs_f64() * 1000.0;
            lock(&self.learned).rates.round_trip(ms);
        }
        remember(&self.last_decode_info, info)
    }

    pub(super) async fn info_within(
        &self,
        call: impl std::future::Future<Output = Result<tonic::Response<pb::NodeInfo>, tonic::Status>>,
        code: &str,
        who: &str,
    ) -> Result<pb::NodeInfo, Failure> {
        match tokio::time::timeout(self.config.info_timeout, call).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            // A misconfiguration, not an outage: retrying will not help.
            Ok(Err(st)) if st.code() == tonic::Code::Unauthenticated => Err(Failure::upstream(
                "auth_failed",
                format!(
                    "{who} refused the router's credential ({}): give all three services the same secret",
                    st.message()
                ),
            )),
            Ok(Err(st)) => Err(match HandshakeFailed::find(&st) {
                // The private link's handshake failed: another secret, or none, on the node.
                Some(h) => Failure::link_refused(who, h),
                // A plain router whose node speaks only TLS reads the node's TLS alert as
                // a broken HTTP/2 stream or a reset connection (which of them varies with
                // timing): say what may have happened.
                None if !self.config.link.is_private() => {
                    Failure::unavailable(
                        code,
                        format!(
                            "{who} is not reachable: {} (if it has a shared secret, give the \
                             router the same one: it then speaks TLS only)",
                            st.message()
                        ),
                    )
                }
                // A connection that broke after its handshake (a status made here, with
                // a source): said as `Failure::from_status` says it.
                None => match std::error::Error::source(&st) {
                    Some(source) => Failure::unavailable(
                        code,
                        format!(
                            "the connection to {who} broke: {} ({source})",
                            st.message()
                        ),
                    ),
                    None => Failure::unavailable(
                        code,
                        format!("{who} is not reachable: {}", st.message()),
                    ),
                },
            }),
            Err(_) => Err(Failure::unavailable(
                code,
                format!("{who} did not answer within {:?}", self.config.info_timeout),
            )),
        }
    }

    /// `Ok` when the prefill node serves a layer split (its last `Info`, else a fresh
    /// one); a 400 naming the transport otherwise.
    pub(super) async fn layer_split_serving(&self) -> Result<(), Failure> {
        let known = lock_info(&self.last_prefill_info).clone();
        let info = match known {
            Some(i) => i,
            None => self.prefill_info().await?,
        };
        match info.layer_split.as_ref().map(|l| l.state.as_str()) {
            Some("split") => Ok(()),
            Some(state) => Err(Failure::invalid(
                Some("edgesplit.transport".to_string()),
                format!(
                    "transport \"layers\": the prefill node's layer split is {state:?} (its RPC \
                     peer was lost; every layer is computed there): use \"local\""
                ),
            )),
            None => Err(Failure::invalid(
                Some("edgesplit.transport".to_string()),
                "transport \"layers\": the prefill node serves no layer split (start it with \
                 --rpc-peer and --rpc-layers)",
            )),
        }
    }
}
