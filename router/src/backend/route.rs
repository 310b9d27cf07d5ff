//! Where and how a request runs: one type for what a request names (its `transport` and
//! `handoff`, resolved with the router's default handoff mode) and what `transport:
//! "auto"`'s cost model (`cost.rs`) chooses. `Backend::run` starts a request on its route.
//!
//! A live handoff goes over V2 only, so `Route` cannot say "live over V1".

use super::Failure;
use crate::api::{HandoffMode, Transport};

/// How a split's state crosses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    /// The framed TCP handoff (PROTOCOL.md).
    V2,
    /// llama.cpp's sequence-state file, by HTTP upload.
    V1,
}

impl Wire {
    /// The transport a client names for it.
    #[must_use]
    pub fn transport(self) -> Transport {
        match self {
            Wire::V2 => Transport::V2,
            Wire::V1 => Transport::V1,
        }
    }
}

/// Where and how a request runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The prefill node alone (`transport: local`).
    Local,
    /// The prefill node with its layer split (`transport: layers`).
    Layers,
    /// The decode node alone: it prefills and writes the answer; only tokens cross
    /// (`transport: phone`).
    Phone,
    /// Prefilled on the prefill node, which writes the answer while the state crosses over
    /// V2, then hands over at a token boundary.
    Live,
    /// Prefilled on the prefill node; the state crosses once after the first token and the
    /// decode node writes the rest.
    After(Wire),
}

impl Route {
    /// The routes `transport: "auto"` chooses among.
    pub const CHOSEN: [Route; 4] = [
        Route::Local,
        Route::Live,
        Route::After(Wire::V2),
        Route::Phone,
    ];

    /// Its name in the `edgesplit` object (`mode`) and the metrics.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Route::Local => "local",
            Route::Layers => "layers",
            Route::Phone => "phone",
            Route::Live => "live",
            Route::After(Wire::V2) => "after",
            Route::After(Wire::V1) => "v1",
        }
    }

    /// A split over `wire` in handoff `mode`.
    ///
    /// # Errors
    /// A live handoff over v1 (400 naming `edgesplit.handoff`).
    pub fn split(wire: Wire, mode: HandoffMode) -> Result<Self, Failure> {
        match (wire, mode) {
            (Wire::V2, HandoffMode::Live) => Ok(Route::Live),
            (Wire::V1, HandoffMode::Live) => Err(Failure::invalid(
                Some("edgesplit.handoff".into()),
                "a live handoff goes over v2 only; use \"after\" with v1",
            )),
            (wire, HandoffMode::After) => Ok(Route::After(wire)),
        }
    }

    /// The route of a request that names `transport` and maybe `handoff`, the router's
    /// `default` handoff mode otherwise (v1 without a named mode: `after`). `None`: the
    /// request asked the router to choose (`auto`).
    ///
    /// # Errors
    /// A live handoff named over v1.
    pub fn named(
        transport: Transport,
        handoff: Option<HandoffMode>,
        default: HandoffMode,
    ) -> Result<Option<Self>, Failure> {
        Ok(Some(match transport {
            Transport::Local => Route::Local,
            Transport::Layers => Route::Layers,
            Transport::Phone => Route::Phone,
            Transport::Auto => return Ok(None),
            Transport::V2 => Route::split(Wire::V2, handoff.unwrap_or(default))?,
            Transport::V1 => Route::split(Wire::V1, handoff.unwrap_or(HandoffMode::After))?,
        }))
    }

    /// The transport a client names for this route (and the answer reports).
    #[must_use]
    pub fn transport(self) -> Transport {
        match self {
            Route::Local => Transport::Local,
            Route::Layers => Transport::Layers,
            Route::Phone => Transport::Phone,
            Route::Live => Transport::V2,
            Route::After(wire) => wire.transport(),
        }
    }

    /// A split's handoff mode (`None`: no state crosses).
    #[must_use]
    pub fn handoff(self) -> Option<HandoffMode> {
        match self {
            Route::Live => Some(HandoffMode::Live),
            Route::After(_) => Some(HandoffMode::After),
            Route::Local | Route::Layers | Route::Phone => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every transport a request names, with and without a handoff mode, resolves to the
    /// route that reports that transport and mode back; a live v1 is refused naming the
    /// field; `auto` is left to the cost model.
    #[test]
    fn a_named_transport_resolves_to_one_route_and_back() {
        use HandoffMode::{After, Live};
        let t = [
            Transport::V2,
            Transport::V1,
            Transport::Local,
            Transport::Layers,
            Transport::Phone,
        ];
        for transport in t {
            for handoff in [None, Some(Live), Some(After)] {
                for default in [Live, After] {
                    let r = Route::named(transport, handoff, default);
                    if transport == Transport::V1 && handoff == Some(Live) {
                        let e = r.unwrap_err();
                        assert_eq!(e.param.as_deref(), Some("edgesplit.handoff"));
                        continue;
                    }
                    let route = r.unwrap().unwrap();
                    assert_eq!(route.transport(), transport, "{route:?}");
                    let want = match transport {
                        Transport::V2 => Some(handoff.unwrap_or(default)),
                        Transport::V1 => Some(After),
                        _ => None,
                    };
                    assert_eq!(route.handoff(), want, "{transport:?} {handoff:?}");
                }
            }
        }
        assert_eq!(
            Route::named(Transport::Auto, Some(Live), Live).unwrap(),
            None
        );
        let names: Vec<_> = Route::CHOSEN.iter().map(|r| r.as_str()).collect();
        assert_eq!(names, ["local", "live", "after", "phone"]);
    }
}
