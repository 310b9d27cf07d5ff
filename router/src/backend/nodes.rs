//! What the router knows of the nodes: their last `Info` answers and their refresh, and
//! what it learns from answers (conversations held, measured rates) to place the next ones.

use edgesplit_proto::link::HandshakeFailed;
use edgesplit_proto::pb;

use super::Failure;
use super::RouterCode;
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
    /// The decode node's silences mid-answer (a pool leaves it out while one holds).
    pub(super) silence: Silence,
    /// Woken when a replay of a held conversation ends (`Conversations::replaying`).
    pub(super) replays: std::sync::Arc<tokio::sync::Notify>,
}

impl Learned {
    /// What another decode node's pair knows at first: the prefill node's rates (shared,
    /// `Rates::beside`) and nothing of its own decode node.
    pub(super) fn beside(&self) -> Learned {
        Learned {
            rates: self.rates.beside(),
            ..Learned::default()
        }
    }

    /// The decode node went silent mid-answer now (the router's clock, which tests may
    /// pause): why, the answer's failure.
    pub(super) fn decode_node_silent(&mut self, why: &str) {
        self.silence
            .fell_silent(tokio::time::Instant::now().into_std(), why);
    }
}

/// The first hold of a decode node that went silent mid-answer; each silence in a row
/// doubles it, up to [`SILENCE_HOLD_MAX`].
pub(super) const SILENCE_HOLD: std::time::Duration = std::time::Duration::from_secs(15);
/// The longest hold.
pub(super) const SILENCE_HOLD_MAX: std::time::Duration = std::time::Duration::from_secs(300);

/// A decode node that sent nothing within the idle bound in the middle of an answer, or
/// did not take an answer handed to it, while its `Info` may still answer (a wedged engine,
/// a stalled link): the pool leaves it out of its choices for a hold, 15 s after the first
/// silence in a row and twice as long after each next one (at most 5 min), and takes it
/// again when the hold ends; an answer it ends well clears the count.
#[derive(Debug, Default)]
pub(super) struct Silence {
    until: Option<std::time::Instant>,
    in_a_row: u32,
    why: String,
}

impl Silence {
    /// The node went silent at `now`: why (the answer's failure).
    pub(super) fn fell_silent(&mut self, now: std::time::Instant, why: &str) {
        let hold = SILENCE_HOLD
            .saturating_mul(1u32 << self.in_a_row.min(8))
            .min(SILENCE_HOLD_MAX);
        self.in_a_row = self.in_a_row.saturating_add(1);
        self.until = Some(now + hold);
        self.why = format!(
            "silent mid-answer ({why}); left out for {}s ({} in a row)",
            hold.as_secs(),
            self.in_a_row
        );
    }

    /// The node ended an answer well.
    pub(super) fn spoke(&mut self) {
        *self = Silence::default();
    }

    /// Why the node is left out at `now`, while a hold lasts.
    pub(super) fn holds(&self, now: std::time::Instant) -> Option<&str> {
        self.until.filter(|&u| now < u).map(|_| self.why.as_str())
    }
}

/// Both nodes' `Info` answers, prefill first.
pub type HealthInfos = (Result<pb::NodeInfo, Failure>, Result<pb::NodeInfo, Failure>);

/// A node's last `Info` answer, and when it came.
type LastInfo = std::sync::Mutex<Option<(std::time::Instant, pb::NodeInfo)>>;

/// The nodes' last `Info` answers: what a request reads of the nodes without asking them.
/// The prefill node's is shared by every pair of a pool ([`Known::beside`]).
#[derive(Debug, Default)]
pub(super) struct Known {
    prefill: std::sync::Arc<LastInfo>,
    decode: LastInfo,
}

fn guard<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A node's `Info` call answered: kept in `last` as its last known one (the result passed
/// on).
fn answered(last: &LastInfo, info: Result<pb::NodeInfo, Failure>) -> Result<pb::NodeInfo, Failure> {
    if let Ok(i) = &info {
        *guard(last) = Some((std::time::Instant::now(), i.clone()));
    }
    info
}

impl Known {
    /// What another decode node's pair knows at first: the same prefill node's `Info`.
    pub(super) fn beside(other: &Known) -> Known {
        Known {
            prefill: other.prefill.clone(),
            decode: LastInfo::default(),
        }
    }

    /// The prefill node's last `Info`.
    pub(super) fn prefill(&self) -> Option<pb::NodeInfo> {
        guard(&self.prefill).as_ref().map(|(_, i)| i.clone())
    }

    /// The prefill node's last `Info` while it is younger than `max_age`.
    fn prefill_within(&self, max_age: std::time::Duration) -> Option<pb::NodeInfo> {
        guard(&self.prefill)
            .as_ref()
            .filter(|(at, _)| at.elapsed() < max_age)
            .map(|(_, i)| i.clone())
    }

    /// The decode node's last `Info`.
    pub(super) fn decode(&self) -> Option<pb::NodeInfo> {
        guard(&self.decode).as_ref().map(|(_, i)| i.clone())
    }

    /// KV bytes per token of the decode node's model, as its last `Info` said (0 before it
    /// answered).
    pub(super) fn decode_kv_bytes_per_token(&self) -> u64 {
        guard(&self.decode)
            .as_ref()
            .map_or(0, |(_, i)| i.kv_bytes_per_token)
    }

    /// A field of each node's last `Info`, prefill first (`None` where a node has not
    /// answered, or `f` says nothing).
    fn both<T>(&self, f: impl Fn(&pb::NodeInfo) -> Option<T>) -> (Option<T>, Option<T>) {
        let prefill = guard(&self.prefill).as_ref().and_then(|(_, i)| f(i));
        let decode = guard(&self.decode).as_ref().and_then(|(_, i)| f(i));
        (prefill, decode)
    }
}

pub(super) fn lock(l: &std::sync::Mutex<Learned>) -> std::sync::MutexGuard<'_, Learned> {
    // A poisoned lock holds nothing an invariant depends on.
    l.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Backend {
    /// Why the decode node is left out after a silence mid-answer, while that holds.
    #[must_use]
    pub fn silent(&self) -> Option<String> {
        lock(&self.learned)
            .silence
            .holds(tokio::time::Instant::now().into_std())
            .map(str::to_string)
    }
}

impl Backend {
    /// KV bytes per token of the model, as the decode node's last `Info` said (else the
    /// prefill node's; 0 before either answered): what the cost model's crossing and a
    /// split's expected work read.
    pub(super) fn kv_bytes_per_token(&self) -> u64 {
        let (prefill, decode) = self.known.both(|i| Some(i.kv_bytes_per_token));
        decode.or(prefill).unwrap_or(0)
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
        let info = self
            .info_within(
                self.prefill.info(),
                RouterCode::PrefillUnavailable,
                "the prefill node",
            )
            .await;
        answered(&self.known.prefill, info)
    }

    /// The prefill node's `Info` for a request: the last answer while it is younger than
    /// `max_age` (no call on the request's path), else asked now.
    pub async fn prefill_info_fresh(
        &self,
        max_age: std::time::Duration,
    ) -> Result<pb::NodeInfo, Failure> {
        match self.known.prefill_within(max_age) {
            Some(i) => Ok(i),
            None => self.prefill_info().await,
        }
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
        let (prefill, decode) = self
            .known
            .both(|i| Some(i.arch.clone()).filter(|a| !a.is_empty()));
        let on_decode = placement == PrefilledOn::DecodeNode;
        let crossed = on_decode || matches!(transport, Transport::V1 | Transport::V2);
        (prefill.filter(|_| !on_decode), decode.filter(|_| crossed))
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
        let (prefill, decode) = self
            .known
            .both(|i| (!i.arch.is_empty()).then(|| (i.arch.clone(), i.kernels.clone())));
        Some(prefill? == decode?)
    }

    /// Whether the decode node renders `input` as the prefill node does: a raw prompt
    /// always; a chat when both nodes' last `Info` name the same chat template (another
    /// template is another prompt, and the decode node renders the chats it continues).
    pub(super) fn renders_alike(&self, input: &Input) -> bool {
        if matches!(input, Input::Prompt(_)) {
            return true;
        }
        let (prefill, decode) = self
            .known
            .both(|i| Some(i.chat_template_fingerprint.clone()).filter(|f| !f.is_empty()));
        prefill.is_some() && prefill == decode
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
        let asked = std::time::Instant::now();
        let info = self.decode_info_unmeasured().await;
        if info.is_ok() {
            let ms = asked.elapsed().as_secs_f64() * 1000.0;
            lock(&self.learned).rates.round_trip(ms);
        }
        info
    }

    /// [`Backend::decode_info`] without taking its time as the link's round trip: the
    /// pool's watch (`pool.rs`) asks twice a second, and under load its answers would
    /// outweigh the round trips of the calls requests make.
    pub(super) async fn decode_info_unmeasured(&self) -> Result<pb::NodeInfo, Failure> {
        let info = self
            .info_within(
                self.decode.info(),
                RouterCode::DecodeUnavailable,
                "the decode node",
            )
            .await;
        answered(&self.known.decode, info)
    }

    pub(super) async fn info_within(
        &self,
        call: impl std::future::Future<Output = Result<pb::NodeInfo, tonic::Status>>,
        code: RouterCode,
        who: &str,
    ) -> Result<pb::NodeInfo, Failure> {
        match tokio::time::timeout(self.config.info_timeout, call).await {
            Ok(Ok(r)) => Ok(r),
            // A misconfiguration, not an outage: retrying will not help.
            Ok(Err(st)) if st.code() == tonic::Code::Unauthenticated => Err(Failure::upstream(
                RouterCode::AuthFailed,
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
        let info = match self.known.prefill() {
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

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::Silence;

    /// Each silence in a row doubles the hold (15 s, 30 s, 60 s ... at most 5 min); an
    /// answer ended well clears the count.
    #[test]
    fn a_silence_holds_a_node_out_longer_each_time_in_a_row() {
        let t0 = Instant::now();
        let mut s = Silence::default();
        assert!(s.holds(t0).is_none());
        s.fell_silent(t0, "no token within 5s");
        assert!(s.holds(t0 + Duration::from_secs(14)).is_some());
        assert!(s.holds(t0 + Duration::from_secs(15)).is_none());
        let why = s.holds(t0).unwrap();
        assert!(
            why.contains("no token within 5s") && why.contains("15s"),
            "{why}"
        );
        s.fell_silent(t0, "again");
        assert!(s.holds(t0 + Duration::from_secs(29)).is_some());
        assert!(s.holds(t0 + Duration::from_secs(30)).is_none());
        for _ in 0..10 {
            s.fell_silent(t0, "again");
        }
        assert!(s.holds(t0 + Duration::from_secs(299)).is_some());
        assert!(s.holds(t0 + Duration::from_secs(300)).is_none());
        s.spoke();
        assert!(s.holds(t0).is_none());
        s.fell_silent(t0, "after an answer");
        assert!(s.holds(t0 + Duration::from_secs(15)).is_none());
    }
}
