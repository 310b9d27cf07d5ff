//! The checksum and seal rules of a STATE frame's trailer: SHA-256 on a plain link, an
//! HMAC under the session key with a secret over a plain stream, nothing of ours inside
//! TLS (zeros, checked).

use sha2::{Digest, Sha256};

/// The STATE checksum: SHA-256, or HMAC-SHA256 under the session key, fed as the body
/// leaves or arrives so that it costs no pass of its own.
#[derive(Clone)]
pub enum StateDigest {
    Plain(Sha256),
    Keyed(hmac::Hmac<Sha256>),
    /// Inside TLS: no digest of ours (see [`Check::Sealed`]); the trailer is 32 zero bytes.
    Sealed,
}

/// How a connection checks the bytes of the states it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Check {
    /// SHA-256 of the body (a plain link without a secret).
    #[default]
    Sha256,
    /// HMAC-SHA256 under the session key of the handshake (a secret over a plain stream).
    Hmac([u8; 32]),
    /// A private link: TLS 1.3 has authenticated every byte of the connection with its
    /// AEAD under keys only the two holders of the secret have, so a digest of ours over
    /// the same bytes would check nothing more and cost a pass of SHA-256 on each side.
    /// The trailer is kept (32 zero bytes, checked) so that the frame layout
    /// does not depend on the link.
    Sealed,
}

impl StateDigest {
    /// The digest `check` asks for.
    #[must_use]
    pub fn new(check: &Check) -> Self {
        use hmac::Mac;
        match check {
            Check::Sha256 => StateDigest::Plain(Sha256::new()),
            Check::Hmac(k) => StateDigest::Keyed(
                hmac::Hmac::<Sha256>::new_from_slice(k).expect("HMAC takes keys of any length"),
            ),
            Check::Sealed => StateDigest::Sealed,
        }
    }

    pub fn update(&mut self, bytes: &[u8]) {
        use hmac::Mac;
        match self {
            StateDigest::Plain(h) => h.update(bytes),
            StateDigest::Keyed(m) => m.update(bytes),
            StateDigest::Sealed => {}
        }
    }

    /// The 32-byte trailer.
    #[must_use]
    pub fn finalize(self) -> [u8; 32] {
        use hmac::Mac;
        match self {
            StateDigest::Plain(h) => h.finalize().into(),
            StateDigest::Keyed(m) => m.finalize().into_bytes().into(),
            StateDigest::Sealed => [0; 32],
        }
    }

    /// Checks a trailer; an HMAC is compared in constant time by the `hmac` crate
    /// (`verify_slice`). A sealed link's trailer must be zeros: a sender that checks
    /// otherwise is not on the same kind of link.
    #[must_use]
    pub fn verify(self, sum: &[u8]) -> bool {
        use hmac::Mac;
        match self {
            StateDigest::Plain(h) => h.finalize().as_slice() == sum,
            StateDigest::Keyed(m) => m.verify_slice(sum).is_ok(),
            StateDigest::Sealed => sum.iter().all(|&b| b == 0),
        }
    }
}
