//! V1 handoff: llama.cpp's own sequence-state file (`llama_state_seq_save_file`), uploaded
//! by HTTP. File layout: `u32 magic 'ggsq' (0x67677371), u32 version, u32 n_tokens,
//! n_tokens x i32 token ids`, then the memory sections (see [`crate::layout`]).
//!
//! Upload: `PUT {v1_url}/{handoff_id}` with `Content-Length`, and the headers below; the
//! body is the file followed by a 32-byte digest of it ([`TRAILER_LEN`], [`digest`]):
//! SHA-256, or over a private link (TLS, which authenticates every byte) 32 zero bytes. The
//! digest comes last so that both sides compute it as the bytes go (the sender while it
//! sends, the receiver while it receives), as V2's STATE trailer is. The receiver answers
//! 200 with `{"handoff_id","bytes"}` or a 4xx OpenAI-style error object whose `code` says
//! why (see the decode node).

/// `LLAMA_STATE_SEQ_MAGIC` ('ggsq').
pub const GGSQ_MAGIC: u32 = 0x6767_7371;
/// `LLAMA_STATE_SEQ_VERSION` of the llama.cpp we build (llama-cpp-sys-2 0.1.161).
pub const FILE_VERSION: u32 = 4;
/// Header: how the body is checked; [`DIGEST_TRAILER`] (the only value): the body ends
/// with the file's digest.
pub const HEADER_DIGEST: &str = "x-edgesplit-digest";
/// [`HEADER_DIGEST`]'s value.
pub const DIGEST_TRAILER: &str = "trailer";
/// Bytes of the digest after the file.
pub const TRAILER_LEN: usize = 32;

/// The digest of handoff `handoff_id`'s file: over a private link (`sealed`: TLS has
/// authenticated every byte, and the upload's credential binds the id and the length)
/// none of ours, the trailer 32 zero bytes ([`crate::frame::Check::Sealed`]); else
/// SHA-256, or with a secret over a plain stream HMAC-SHA256 keyed by the secret and the
/// handoff id (a body made for one id does not pass for another).
#[must_use]
pub fn digest(
    secret: Option<&crate::auth::Secret>,
    handoff_id: &str,
    sealed: bool,
) -> crate::frame::StateDigest {
    use crate::frame::{Check, StateDigest};
    match secret {
        _ if sealed => StateDigest::new(&Check::Sealed),
        Some(s) => StateDigest::new(&Check::Hmac(
            s.mac(crate::auth::V1_DIGEST, &[handoff_id.as_bytes()]),
        )),
        None => StateDigest::new(&Check::Sha256),
    }
}
/// Header: model fingerprint (SHA-256 of the GGUF), lowercase hex.
pub const HEADER_MODEL: &str = "x-edgesplit-model-fingerprint";
/// Header: llama.cpp build identity.
pub const HEADER_BUILD: &str = "x-edgesplit-build";
/// Header: the sender's KV cache types, `"{type_k},{type_v}"` (ggml type ids).
pub const HEADER_KV_TYPES: &str = "x-edgesplit-kv-types";
/// Header: request id, for logs.
pub const HEADER_REQUEST: &str = "x-edgesplit-request-id";

/// The fixed part of a sequence-state file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileHeader {
    pub version: u32,
    pub n_tokens: u32,
    /// Byte offset where the memory sections start.
    pub state_offset: usize,
}

/// Why a sequence-state file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FileError {
    #[error("not a llama.cpp sequence-state file (magic {0:#010x}, expected 'ggsq')")]
    BadMagic(u32),
    #[error("sequence-state file version {0}, this build reads version {FILE_VERSION}")]
    Version(u32),
    #[error("file of {len} bytes is shorter than its {n_tokens} token ids")]
    Truncated { len: usize, n_tokens: u32 },
    #[error("{n_tokens} tokens do not fit the context of {max}")]
    TooLong { n_tokens: u32, max: u32 },
    #[error("the state in the file could not be read")]
    Layout,
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Checks the header of `file` (at least its first 12 bytes plus the token ids).
///
/// # Errors
/// Wrong magic or version, a token count past the bytes present or past `max_tokens`.
pub fn parse_header(file: &[u8], max_tokens: u32) -> Result<FileHeader, FileError> {
    let short = FileError::Truncated {
        len: file.len(),
        n_tokens: 0,
    };
    let magic = u32_at(file, 0).ok_or(short.clone())?;
    if magic != GGSQ_MAGIC {
        return Err(FileError::BadMagic(magic));
    }
    let version = u32_at(file, 4).ok_or(short.clone())?;
    if version != FILE_VERSION {
        return Err(FileError::Version(version));
    }
    let n_tokens = u32_at(file, 8).ok_or(short)?;
    if n_tokens >= max_tokens {
        return Err(FileError::TooLong {
            n_tokens,
            max: max_tokens,
        });
    }
    let state_offset = 12 + n_tokens as usize * 4;
    if file.len() < state_offset {
        return Err(FileError::Truncated {
            len: file.len(),
            n_tokens,
        });
    }
    Ok(FileHeader {
        version,
        n_tokens,
        state_offset,
    })
}

/// The file header of a sequence state covering `tokens`: magic, version, token count,
/// token ids. The file is this, then the state without its 8-byte io header
/// ([`raw_sections`]): what `llama_state_seq_save_file` writes, built in memory.
#[must_use]
pub fn file_head(tokens: &[i32]) -> Vec<u8> {
    let mut f = Vec::with_capacity(12 + tokens.len() * 4);
    f.extend_from_slice(&GGSQ_MAGIC.to_le_bytes());
    f.extend_from_slice(&FILE_VERSION.to_le_bytes());
    f.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    for t in tokens {
        f.extend_from_slice(&t.to_le_bytes());
    }
    f
}

/// Where the memory sections start in a raw state (`llama_state_seq_get_data`: `u32 magic,
/// i32 seq id`, then the sections, which a file carries after its header), or `None` when
/// `raw` does not start with that io header.
#[must_use]
pub fn raw_sections(raw: &[u8]) -> Option<usize> {
    (u32_at(raw, 0)? == crate::layout::STATE_MAGIC && raw.len() >= 8).then_some(8)
}

/// Turns a verified file into a raw state in place: reads its token ids, then writes the
/// raw state's io header (magic, sequence 0) over the 8 bytes just before the sections, so
/// `file[start..]` is what `llama_state_seq_set_data` reads, without copying the state.
/// Returns `(start, token ids)`.
#[must_use]
pub fn raw_in_place(file: &mut [u8], header: &FileHeader) -> (usize, Vec<i32>) {
    let at = header.state_offset;
    let tokens = file[12..at]
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    // `at` is at least 12 (the fixed header), so the 8 bytes before it exist.
    let start = at - 8;
    file[start..start + 4].copy_from_slice(&crate::layout::STATE_MAGIC.to_le_bytes());
    file[start + 4..at].copy_from_slice(&0i32.to_le_bytes());
    (start, tokens)
}

/// Validates a whole file: header, and a state that walks exactly to the end with as many
/// cells as tokens. Returns the header.
///
/// # Errors
/// As [`parse_header`], or [`FileError::Layout`].
pub fn validate(file: &[u8], max_tokens: u32) -> Result<FileHeader, FileError> {
    let h = parse_header(file, max_tokens)?;
    let layout =
        crate::layout::describe_sections(&file[h.state_offset..]).ok_or(FileError::Layout)?;
    if layout.max_cells != Some(u64::from(h.n_tokens)) {
        return Err(FileError::Layout);
    }
    Ok(h)
}

/// Converts a version-4 file to version 3, the format of the stock llama.cpp that the
/// llama-cpp-python 0.3.36 sources carry (it lacks the per-stream `n_rot_k, n_rot_v`).
///
/// # Errors
/// A file that is not a valid version-4 file.
pub fn to_version_3(file: &[u8]) -> Result<Vec<u8>, FileError> {
    let h = parse_header(file, u32::MAX)?;
    let body =
        crate::layout::sections_v4_to_v3(&file[h.state_offset..]).ok_or(FileError::Layout)?;
    let mut out = Vec::with_capacity(h.state_offset + body.len());
    out.extend_from_slice(&file[..4]);
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&file[8..h.state_offset]);
    out.extend_from_slice(&body);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(tokens: &[i32], body: &[u8]) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&GGSQ_MAGIC.to_le_bytes());
        f.extend_from_slice(&FILE_VERSION.to_le_bytes());
        f.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
        for t in tokens {
            f.extend_from_slice(&t.to_le_bytes());
        }
        f.extend_from_slice(body);
        f
    }

    #[test]
    fn a_file_built_in_memory_turns_back_into_the_raw_state_in_place() {
        let mut raw = crate::layout::STATE_MAGIC.to_le_bytes().to_vec();
        raw.extend_from_slice(&0i32.to_le_bytes());
        raw.extend_from_slice(&body());
        let tokens = [5, -6, 70_000];
        for tokens in [&tokens[..], &tokens[..1], &[][..]] {
            let at = raw_sections(&raw).unwrap();
            let mut f = file_head(tokens);
            f.extend_from_slice(&raw[at..]);
            assert_eq!(f, file(tokens, &body()));
            let h = parse_header(&f, 100).unwrap();
            let (start, back) = raw_in_place(&mut f, &h);
            assert_eq!(back, tokens);
            assert_eq!(&f[start..], &raw[..]);
        }
        assert_eq!(raw_sections(&body()), None);
    }

    /// One stream, one cell, one layer, K and V of 4 bytes.
    fn body() -> Vec<u8> {
        let mut v = Vec::new();
        for x in [1u32, 1, 0, 1, 0, 0, 1, 0, 0] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        for _ in 0..2 {
            v.extend_from_slice(&1u32.to_le_bytes());
            v.extend_from_slice(&4u64.to_le_bytes());
            v.extend_from_slice(&[1, 2, 3, 4]);
        }
        v
    }

    #[test]
    fn valid_file_passes_and_converts() {
        let f = file(&[42], &body());
        let h = validate(&f, 100).unwrap();
        assert_eq!(h.n_tokens, 1);
        assert_eq!(h.state_offset, 16);
        let v3 = to_version_3(&f).unwrap();
        assert_eq!(v3.len(), f.len() - 8);
        assert_eq!(u32_at(&v3, 4), Some(3));
    }

    #[test]
    fn refusals() {
        let mut f = file(&[42], &body());
        assert_eq!(
            validate(&f, 1),
            Err(FileError::TooLong {
                n_tokens: 1,
                max: 1
            })
        );
        f[0] = b'x';
        assert!(matches!(validate(&f, 100), Err(FileError::BadMagic(_))));
        let mut f = file(&[42], &body());
        f[4] = 3;
        assert_eq!(validate(&f, 100), Err(FileError::Version(3)));
        let f = file(&[42, 43], &body());
        assert_eq!(validate(&f, 100), Err(FileError::Layout)); // 1 cell, 2 tokens
        let f = file(&[42], &body()[..10]);
        assert_eq!(validate(&f, 100), Err(FileError::Layout));
        let mut f = file(&[], &[]);
        f[8] = 200;
        assert!(matches!(
            validate(&f, 1000),
            Err(FileError::Truncated { .. })
        ));
        assert!(matches!(
            validate(&[1, 2], 10),
            Err(FileError::Truncated { .. })
        ));
    }
}
