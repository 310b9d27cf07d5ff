//! A pool of decode nodes (`--decode-url` repeated): one [`Backend`] pair per decode node,
//! all with the same prefill node, whose client, last `Info` and queue of work the pairs
//! share (`Backend::beside`). Each pair keeps its decode node's own `Info`, measured
//! figures, load and held conversations.
//!
//! Each request goes to one pair ([`Pool::start`]):
//! - a conversation a usable decode node holds goes on there (its KV is there);
//! - a request that names a node (`edgesplit.node`) goes to it;
//! - `auto` asks every usable pair's cost model and takes the best of their choices under
//!   the request's objective ([`best`]): the prefill node alone is the same on every pair, each
//!   pair adds its decode node's modes;
//! - a named split or `phone` goes to the usable decode node with the least work queued.
//!
//! Usable: the node answered its last `Info` and computes as the prefill node does (same
//! model, build, KV cache types and flash attention: the handoff's handshake would refuse
//! it otherwise). [`Pool::watch`] asks every node's `Info` twice a second, so a node that
//! died is left out from its first failed `Info` and taken again within a second of its
//! return. An answer under way on a node that dies finishes on the prefill node (the
//! pair's fallback), as with one decode node. A pool of one uses its node whatever its
//! state: its own failures explain themselves.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use edgesplit_proto::pb;

use super::choice::{others_said, AutoPlan};
use super::cost::{Choice, OFFLOAD_BOUND};
use super::route::Route;
use super::{Backend, Failure, RouterCode, Started};
use crate::api::{Objective, Transport, ValidRequest};

/// How often [`Pool::watch`] asks the decode nodes' `Info`.
pub const WATCH_EVERY: Duration = Duration::from_millis(500);

/// What the router knows of one decode node's fitness.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeState {
    /// Not asked yet.
    Unknown,
    /// It answered its last `Info`, and computes as the prefill node does.
    Ready,
    /// Its last `Info` failed: why.
    Down(String),
    /// It answered, but the handoff's handshake would refuse it: why.
    Refused(String),
    /// It answers `Info`, but went silent in the middle of an answer and is left out
    /// until its hold ends (`nodes::Silence`): why.
    Silent(String),
}

impl NodeState {
    /// A decode node's state from its `Info` answer and the prefill node's (`None`: not
    /// known, nothing to compare with).
    #[must_use]
    pub fn of(prefill: Option<&pb::NodeInfo>, decode: &Result<pb::NodeInfo, Failure>) -> Self {
        match decode {
            Err(e) => NodeState::Down(e.message.clone()),
            Ok(d) => match prefill.and_then(|p| refusal(p, d)) {
                Some(why) => NodeState::Refused(why),
                None => NodeState::Ready,
            },
        }
    }

    /// The state's name (`/health`, the dashboard).
    #[must_use]
    pub fn as_str(&self) -> &'static str {
        match self {
            NodeState::Unknown => "unknown",
            NodeState::Ready => "ready",
            NodeState::Down(_) => "down",
            NodeState::Refused(_) => "refused",
            NodeState::Silent(_) => "silent",
        }
    }

    /// This state, or [`NodeState::Silent`] for a ready node while a silence holds it out
    /// (`silent`: why).
    #[must_use]
    pub fn unless_silent(self, silent: Option<String>) -> Self {
        match (self, silent) {
            (NodeState::Ready, Some(why)) => NodeState::Silent(why),
            (state, _) => state,
        }
    }

    /// Why the node is not used (`None` when it is ready or not asked yet).
    #[must_use]
    pub fn why(&self) -> Option<&str> {
        match self {
            NodeState::Down(w) | NodeState::Refused(w) | NodeState::Silent(w) => Some(w),
            NodeState::Unknown | NodeState::Ready => None,
        }
    }
}

struct Member {
    backend: Backend,
    state: Mutex<NodeState>,
}

/// The decode nodes and the pairs they make with the prefill node. Nodes may be added and
/// removed while it serves ([`Pool::add`], [`Pool::remove`]); a request works on the pairs
/// as they were when it started, and an answer under way on a removed node finishes there.
pub struct Pool {
    members: std::sync::RwLock<Vec<Arc<Member>>>,
    /// The pair new nodes are made beside: the first node's, or, in a pool made without
    /// any, one whose decode side is never called (its URL is [`NO_NODE`]).
    template: Backend,
}

/// The decode URL of an empty pool's template pair: never dialed.
const NO_NODE: &str = "http://127.0.0.1:1";

/// The most decode nodes a pool takes.
pub const MAX_NODES: usize = 16;

/// Why a decode node answering `decode` would be refused by a prefill node answering
/// `prefill` (the handshake's checks, read from both `Info`s), or `None`.
#[must_use]
pub fn refusal(prefill: &pb::NodeInfo, decode: &pb::NodeInfo) -> Option<String> {
    if decode.model_fingerprint != prefill.model_fingerprint {
        return Some(format!(
            "another model: {} (the prefill node's: {})",
            decode.model_id, prefill.model_id
        ));
    }
    if decode.build_id != prefill.build_id {
        return Some(format!(
            "another build: {} (the prefill node's: {})",
            decode.build_id, prefill.build_id
        ));
    }
    if (decode.type_k, decode.type_v) != (prefill.type_k, prefill.type_v) {
        return Some("another KV cache type".into());
    }
    if decode.flash_attn != prefill.flash_attn {
        return Some(format!(
            "flash attention {} (the prefill node's: {})",
            on_off(decode.flash_attn),
            on_off(prefill.flash_attn)
        ));
    }
    None
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// One pair's `auto` choice, as [`best`] compares them.
#[derive(Debug, Clone)]
pub struct Candidate<'a> {
    pub choice: &'a Choice,
    /// Node time (ms) the work queued on this pair's decode node has left.
    pub decode_node_backlog_ms: f64,
}

/// Which of the pairs' `auto` choices runs (an index into `candidates`, which is not
/// empty), under `objective` with `prefill_node_busy` answers on the shared prefill node:
/// - while no pair has a prediction, the one whose decode node has the least work queued;
/// - a pair with no prediction whose decode node is idle is tried (its figures are
///   measured by that answer), so that a node that joins is measured;
/// - else the choice the objective prefers, as `cost::choose` ranks modes: the soonest
///   end (`latency`), the least prefill-node time among those ending within
///   [`OFFLOAD_BOUND`] of the soonest (`offload`), `balanced` as `latency` on an idle
///   prefill node and `offload` on a busy one.
#[must_use]
pub fn best(candidates: &[Candidate<'_>], objective: Objective, prefill_node_busy: usize) -> usize {
    let least_queued = |among: &mut dyn Iterator<Item = (usize, &Candidate<'_>)>| {
        among
            .min_by(|a, b| {
                a.1.decode_node_backlog_ms
                    .total_cmp(&b.1.decode_node_backlog_ms)
            })
            .map_or(0, |(i, _)| i)
    };
    let predicted: Vec<(usize, super::cost::Cost)> = candidates
        .iter()
        .enumerate()
        .filter_map(|(i, c)| c.choice.predicted.map(|p| (i, p)))
        .collect();
    if predicted.is_empty() {
        return least_queued(&mut candidates.iter().enumerate());
    }
    if let Some(i) = candidates
        .iter()
        .position(|c| c.choice.predicted.is_none() && c.decode_node_backlog_ms == 0.0)
    {
        return i;
    }
    let effective = match objective {
        Objective::Balanced if prefill_node_busy == 0 => Objective::Latency,
        Objective::Balanced => Objective::Offload,
        o => o,
    };
    let soonest = predicted
        .iter()
        .map(|(_, c)| c.e2e_ms)
        .fold(f64::INFINITY, f64::min);
    let ranked = predicted.iter().min_by(|a, b| match effective {
        Objective::Offload => {
            let within = |c: &super::cost::Cost| c.e2e_ms <= soonest * OFFLOAD_BOUND;
            within(&b.1)
                .cmp(&within(&a.1))
                .then(a.1.prefill_node_ms.total_cmp(&b.1.prefill_node_ms))
                .then(a.1.e2e_ms.total_cmp(&b.1.e2e_ms))
        }
        _ => a.1.e2e_ms.total_cmp(&b.1.e2e_ms),
    });
    ranked.map_or(0, |(i, _)| *i)
}

impl Pool {
    /// The pairs of the prefill node `config` names with each of `decode_urls` (at least
    /// one), over gRPC.
    ///
    /// # Errors
    /// No decode node, or a malformed URL.
    pub fn new(config: super::BackendConfig, decode_urls: &[String]) -> anyhow::Result<Pool> {
        anyhow::ensure!(
            decode_urls.len() <= MAX_NODES,
            "{} decode nodes: a pool takes at most {MAX_NODES}",
            decode_urls.len()
        );
        let Some((first, rest)) = decode_urls.split_first() else {
            let template = Backend::new(super::BackendConfig {
                decode_url: NO_NODE.to_string(),
                ..config
            })?;
            return Ok(Pool {
                members: std::sync::RwLock::default(),
                template,
            });
        };
        let first = Backend::new(super::BackendConfig {
            decode_url: first.clone(),
            ..config
        })?;
        let mut backends = vec![first.clone()];
        for url in rest {
            anyhow::ensure!(
                decode_urls.iter().filter(|u| *u == url).count() == 1,
                "--decode-url {url} is given twice"
            );
            backends.push(first.beside(url.clone(), first.grpc_decode(url, "")?));
        }
        Ok(Pool::of(backends))
    }

    /// A pool of `backends` (at least one), pairs of one prefill node (the first's,
    /// shared through `Backend::beside`).
    #[must_use]
    pub fn of(backends: Vec<Backend>) -> Pool {
        Pool {
            template: backends[0].clone(),
            members: std::sync::RwLock::new(
                backends
                    .into_iter()
                    .map(|backend| {
                        Arc::new(Member {
                            backend,
                            state: Mutex::new(NodeState::Unknown),
                        })
                    })
                    .collect(),
            ),
        }
    }

    /// The pairs as they are now.
    fn members(&self) -> Vec<Arc<Member>> {
        self.members
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The first pair (the template's when there is no node): what the prefill node
    /// answers is the same on every pair.
    #[must_use]
    pub fn first(&self) -> Backend {
        self.members()
            .first()
            .map_or_else(|| self.template.clone(), |m| m.backend.clone())
    }

    /// How many decode nodes the pool has.
    #[must_use]
    pub fn len(&self) -> usize {
        self.members().len()
    }

    /// No decode node: every request is answered on the prefill node.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.members().is_empty()
    }

    /// Adds the decode node at `url` while the router serves: its pair is made beside the
    /// first, its `Info` asked at once (the state it gives is returned), and its
    /// calibration started when the router probes. Requests consider it once its
    /// calibration is done.
    ///
    /// # Errors
    /// A 400 naming `url`: malformed, already in the pool, or the pool full.
    pub async fn add(&self, url: &str) -> Result<NodeState, Failure> {
        self.adopt(self.pair_with(url, "")?).await
    }

    /// A pair of the prefill node with the decode node at `url` (reached under the link
    /// key of the joined device `device`, when not empty), made beside the first but not
    /// in the pool (a joined device's qualification; [`Pool::adopt`] takes it in).
    ///
    /// # Errors
    /// A 400 naming `url`: malformed.
    pub fn pair_with(&self, url: &str, device: &str) -> Result<Backend, Failure> {
        let first = self.first();
        let decode = first.grpc_decode(url, device).map_err(|e| {
            Failure::invalid(
                Some("url".to_string()),
                format!("{url:?} is not a node URL: {e}"),
            )
        })?;
        Ok(first.beside(url.to_string(), decode).keyed(device))
    }

    /// Adds `backend`, a pair made with [`Backend::beside`] the first (what
    /// [`Pool::add`] makes over gRPC; scripted nodes in unit tests).
    ///
    /// # Errors
    /// A 400 naming `url`: its node already in the pool, or the pool full.
    pub async fn adopt(&self, backend: Backend) -> Result<NodeState, Failure> {
        let url = backend.decode_url();
        let invalid = |m: String| Failure::invalid(Some("url".to_string()), m);
        let member = Arc::new(Member {
            backend: backend.clone(),
            state: Mutex::new(NodeState::Unknown),
        });
        {
            let mut members = self
                .members
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if members.iter().any(|m| m.backend.decode_url() == url) {
                return Err(invalid(format!(
                    "{url} is already a decode node of the router"
                )));
            }
            if members.len() >= MAX_NODES {
                return Err(invalid(format!(
                    "the router has {MAX_NODES} decode nodes, the most it takes"
                )));
            }
            members.push(member.clone());
        }
        tracing::info!(node = %url, "decode node added");
        let prefill = self.first().known.prefill();
        let state = NodeState::of(prefill.as_ref(), &backend.decode_info().await);
        *member
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = state.clone();
        if backend.config.probes {
            tokio::spawn(async move { backend.calibrate().await });
        }
        Ok(state)
    }

    /// Removes the decode node at `url`: no new request goes to it (answers under way
    /// there finish).
    ///
    /// # Errors
    /// A 400 naming `url`: not a node of the router.
    pub fn remove(&self, url: &str) -> Result<(), Failure> {
        let invalid = |m: String| Failure::invalid(Some("url".to_string()), m);
        let mut members = self
            .members
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let i = members
            .iter()
            .position(|m| m.backend.decode_url() == url)
            .ok_or_else(|| invalid(format!("{url} is not a decode node of the router")))?;
        members.remove(i);
        tracing::info!(node = %url, "decode node removed");
        Ok(())
    }

    /// Each decode node's URL and state as [`Pool::watch`] last set it, in `--decode-url`
    /// order.
    #[must_use]
    pub fn states(&self) -> Vec<(String, NodeState)> {
        self.members()
            .iter()
            .map(|m| (m.backend.decode_url(), state_of(m)))
            .collect()
    }

    /// Each decode node's URL, in `--decode-url` order.
    #[must_use]
    pub fn urls(&self) -> Vec<String> {
        self.members()
            .iter()
            .map(|m| m.backend.decode_url())
            .collect()
    }

    /// Why the decode node at `url` is left out after a silence, while that holds
    /// (`nodes::Silence`).
    #[must_use]
    pub fn silent(&self, url: &str) -> Option<String> {
        self.members()
            .iter()
            .find(|m| m.backend.decode_url() == url)
            .and_then(|m| m.backend.silent())
    }

    /// Asks every decode node's `Info` (at once) and sets each one's state from it.
    pub async fn watch(&self) {
        let prefill = match self.first().known.prefill() {
            Some(i) => Some(i),
            None => self.first().prefill_info().await.ok(),
        };
        let members = self.members();
        let infos =
            futures::future::join_all(members.iter().map(|m| m.backend.decode_info_unmeasured()))
                .await;
        for (m, info) in members.iter().zip(infos) {
            let state = NodeState::of(prefill.as_ref(), &info);
            let mut last = m
                .state
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if *last != state {
                let url = m.backend.decode_url();
                match state.why() {
                    Some(why) => {
                        tracing::warn!(node = %url, state = state.as_str(), why, "decode node");
                    }
                    None => tracing::info!(node = %url, state = state.as_str(), "decode node"),
                }
                *last = state;
            }
        }
    }

    /// The prefill node's `Info` and each decode node's (`/health`, the dashboard), each
    /// pair's last answers while younger than `max_age` (`Backend::infos_within`).
    pub async fn infos_within(
        &self,
        max_age: Duration,
    ) -> (
        Result<pb::NodeInfo, Failure>,
        Vec<Result<pb::NodeInfo, Failure>>,
    ) {
        let members = self.members();
        if members.is_empty() {
            return (self.template.prefill_info().await, Vec::new());
        }
        let infos =
            futures::future::join_all(members.iter().map(|m| m.backend.infos_within(max_age)))
                .await;
        let mut prefill = Vec::with_capacity(1);
        let decode = infos
            .into_iter()
            .map(|(p, d)| {
                if prefill.is_empty() {
                    prefill.push(p);
                }
                d
            })
            .collect();
        // At least one pair (an empty pool answered above).
        let prefill = prefill.pop().unwrap_or_else(|| {
            Err(Failure::unavailable(
                super::RouterCode::DecodeUnavailable,
                "the router has no decode node",
            ))
        });
        (prefill, decode)
    }

    /// Each decode node's URL and its `Info`, asked now (the dashboard).
    pub async fn decode_infos(&self) -> Vec<(String, Result<pb::NodeInfo, Failure>)> {
        let members = self.members();
        let infos =
            futures::future::join_all(members.iter().map(|m| m.backend.decode_info())).await;
        members
            .iter()
            .map(|m| m.backend.decode_url())
            .zip(infos)
            .collect()
    }

    /// The sequences the decode nodes that answer serve at once, added (`None` when none
    /// answers): the router's admission limit follows it.
    pub async fn decode_parallel(&self) -> Option<usize> {
        let infos = self.decode_infos().await;
        let parallel: Vec<usize> = infos
            .into_iter()
            .filter_map(|(_, info)| info.ok())
            .filter(|i| i.parallel > 0)
            .map(|i| i.parallel as usize)
            .collect();
        (!parallel.is_empty()).then(|| parallel.iter().sum())
    }

    /// Starts `req` on `transport` on the pair chosen for it; returns once the first token
    /// (or an error) is known, with the pair.
    ///
    /// # Errors
    /// The request's failure before its first token, as the client should see it; a
    /// 400 for a node the router does not have, or a node named for a transport that
    /// uses none.
    pub async fn start(
        &self,
        req: &ValidRequest,
        transport: Transport,
        request_id: &str,
    ) -> Result<(Started, Backend), Failure> {
        let members = self.members();
        let pair = |i: usize| members[i].backend.clone();
        let first = self.first();
        let route = Route::named(transport, req.handoff, first.config.handoff)?;
        let named = req
            .node
            .as_deref()
            .map(|n| named(&members, n))
            .transpose()?;
        if members.is_empty() {
            return match route {
                Some(Route::Local | Route::Layers) | None => {
                    let route = route.unwrap_or(Route::Local);
                    Ok((first.run(req, route, request_id).await?, first))
                }
                _ => Err(Failure::unavailable(
                    RouterCode::DecodeUnavailable,
                    "the router has no decode node: join one (--join-listen) or give \
                     --decode-url; transport auto or local answers on the prefill node",
                )),
            };
        }
        if let (Some(Route::Local | Route::Layers), Some(_)) = (route, named) {
            return Err(Failure::invalid(
                Some("edgesplit.node".to_string()),
                format!(
                    "transport {:?} runs on the prefill node: it uses no decode node",
                    transport.as_str()
                ),
            ));
        }
        let usable = match named {
            Some(i) => vec![i],
            None => usable(&members),
        };
        let held = usable
            .iter()
            .copied()
            .find(|&i| members[i].backend.held(req).is_some());
        let backlog =
            |i: usize| -> f64 { members[i].backend.load.backlog().decode_node.iter().sum() };
        match route {
            Some(route @ (Route::Local | Route::Layers)) => {
                Ok((first.run(req, route, request_id).await?, first))
            }
            Some(route) => {
                let i = held.unwrap_or_else(|| {
                    usable
                        .iter()
                        .copied()
                        .min_by(|&a, &b| backlog(a).total_cmp(&backlog(b)))
                        .unwrap_or(0)
                });
                let b = pair(i);
                Ok((b.run(req, route, request_id).await?, b))
            }
            None => {
                // A pair still calibrating is not asked (its plan would wait for it), unless
                // every one is.
                let calibrated: Vec<usize> = usable
                    .iter()
                    .copied()
                    .filter(|&i| members[i].backend.is_calibrated())
                    .collect();
                let asked = if calibrated.is_empty() {
                    usable
                } else {
                    calibrated
                };
                if let Some(i) = held.or((asked.len() == 1).then_some(asked[0])) {
                    let b = pair(i);
                    return Ok((b.start_auto(req, request_id).await?, b));
                }
                let mut plans: Vec<(usize, AutoPlan)> = Vec::with_capacity(asked.len());
                for &i in &asked {
                    plans.push((i, members[i].backend.plan_auto(req).await?));
                }
                let candidates: Vec<Candidate<'_>> = plans
                    .iter()
                    .map(|(i, p)| Candidate {
                        choice: &p.choice,
                        decode_node_backlog_ms: backlog(*i),
                    })
                    .collect();
                let objective = req.objective.unwrap_or(first.config.objective);
                let prefill_node_busy = first.load.backlog().prefill_node.len();
                let k = best(&candidates, objective, prefill_node_busy);
                let urls: Vec<String> = plans
                    .iter()
                    .map(|(i, _)| members[*i].backend.decode_url())
                    .collect();
                let others = others_said(&plans, &urls, k);
                let (i, mut plan) = plans.swap_remove(k);
                plan.choice.reason.push_str(&others);
                let b = pair(i);
                Ok((b.run_auto(req, plan, request_id).await?, b))
            }
        }
    }

    /// The calibration at start (`probe.rs`), one pair after the other: each measures the
    /// prefill node, its decode node and its link, alone.
    pub async fn calibrate(&self) {
        for m in self.members() {
            m.backend.calibrate().await;
        }
    }

    /// At an idle moment: each pair's stale probes (`probe.rs`), one pair after the other.
    pub async fn measure_idle(&self) {
        for m in self.members() {
            m.backend.measure_idle().await;
        }
    }
}

fn state_of(m: &Member) -> NodeState {
    m.state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
        .unless_silent(m.backend.silent())
}

/// The pairs a request may go to, as indices into `members`: the ready ones; when none is,
/// those not refused; else the first (its failures then explain themselves). A pool of
/// one: its pair.
fn usable(members: &[Arc<Member>]) -> Vec<usize> {
    if members.len() == 1 {
        return vec![0];
    }
    let states: Vec<NodeState> = members.iter().map(|m| state_of(m)).collect();
    let ready: Vec<usize> = (0..states.len())
        .filter(|&i| states[i] == NodeState::Ready)
        .collect();
    if !ready.is_empty() {
        return ready;
    }
    let not_refused: Vec<usize> = (0..states.len())
        .filter(|&i| !matches!(states[i], NodeState::Refused(_)))
        .collect();
    if not_refused.is_empty() {
        vec![0]
    } else {
        not_refused
    }
}

/// The pair the request names (`edgesplit.node`), as an index into `members`.
fn named(members: &[Arc<Member>], node: &str) -> Result<usize, Failure> {
    members
        .iter()
        .position(|m| m.backend.decode_url() == node)
        .ok_or_else(|| {
            let urls: Vec<String> = members.iter().map(|m| m.backend.decode_url()).collect();
            Failure::invalid(
                Some("edgesplit.node".to_string()),
                format!("no decode node {node:?}; the router's: {}", urls.join(", ")),
            )
        })
}
