//! Token bytes -> text deltas: incremental UTF-8 decoding, stop strings, and tool calls
//! held back.
//!
//! A token may end inside a multi-byte character, and a stop string may span tokens, so
//! text is released only once it can no longer change: complete characters that cannot be
//! the start of a stop string. With a hold marker (a tool call's start), everything from
//! the marker on is held to the end of the answer, where it is read for calls.

/// Assembles the answer's text from token pieces.
#[derive(Debug, Default)]
pub struct TextAssembler {
    stops: Vec<String>,
    /// Bytes of an incomplete UTF-8 character.
    pending: Vec<u8>,
    /// Decoded text that may still turn out to begin a stop string.
    held: String,
    stopped: bool,
    /// Text from this marker on is held until [`TextAssembler::finish`].
    hold_from: Option<&'static str>,
    /// The marker has come: `held` starts with it.
    holding: bool,
}

/// What pushing a piece produced.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Delta {
    /// Text now safe to send.
    pub text: String,
    /// A stop string matched: the answer ends here (the stop string is not included).
    pub stopped: bool,
}

impl TextAssembler {
    #[must_use]
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            ..Self::default()
        }
    }

    /// Holds everything from `marker` on (see the module's docs).
    #[must_use]
    pub fn holding_from(mut self, marker: &'static str) -> Self {
        self.hold_from = Some(marker);
        self
    }

    /// Adds one token's bytes.
    pub fn push(&mut self, bytes: &[u8]) -> Delta {
        if self.stopped {
            return Delta {
                text: String::new(),
                stopped: true,
            };
        }
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(s) => s.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(), // incomplete tail: wait
            Err(_) => {
                // Invalid bytes (not just incomplete): replace them, as llama-server does.
                let s = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending.clear();
                self.held.push_str(&s);
                return self.release();
            }
        };
        let rest = self.pending.split_off(valid);
        let done = std::mem::replace(&mut self.pending, rest);
        // `done` is valid UTF-8 by construction.
        self.held
            .push_str(std::str::from_utf8(&done).unwrap_or_default());
        self.release()
    }

    fn release(&mut self) -> Delta {
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            self.held.truncate(at);
            self.stopped = true;
            self.pending.clear();
            return Delta {
                text: std::mem::take(&mut self.held),
                stopped: true,
            };
        }
        if self.holding {
            return Delta::default();
        }
        if let Some(at) = self.hold_from.and_then(|m| self.held.find(m)) {
            self.holding = true;
            let rest = self.held.split_off(at);
            return Delta {
                text: std::mem::replace(&mut self.held, rest),
                stopped: false,
            };
        }
        // Keep the longest suffix of `held` that is a proper prefix of some stop string
        // (or of the hold marker).
        let mut keep = 0;
        for s in self.stops.iter().map(String::as_str).chain(self.hold_from) {
            for (i, _) in s.char_indices().skip(1) {
                if self.held.ends_with(&s[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.held.len() - keep;
        let rest = self.held.split_off(cut);
        Delta {
            text: std::mem::replace(&mut self.held, rest),
            stopped: false,
        }
    }

    /// The end of the answer: everything still held is released.
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        let mut out = std::mem::take(&mut self.held);
        if !self.pending.is_empty() {
            out.push_str(&String::from_utf8_lossy(&self.pending));
            self.pending.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multibyte_characters_split_across_tokens() {
        let mut a = TextAssembler::new(vec![]);
        let snow = "é☃".as_bytes();
        assert_eq!(a.push(&snow[..1]).text, "");
        assert_eq!(a.push(&snow[1..3]).text, "é");
        assert_eq!(a.push(&snow[3..]).text, "☃");
        assert_eq!(a.finish(), "");
    }

    #[test]
    fn stop_string_across_tokens_is_cut_and_not_sent() {
        let mut a = TextAssembler::new(vec!["END".into()]);
        assert_eq!(a.push(b"hello E").text, "hello ");
        assert_eq!(a.push(b"N").text, "");
        let d = a.push(b"Dtrailing");
        assert_eq!(
            d,
            Delta {
                text: String::new(),
                stopped: true
            }
        );
        assert_eq!(a.finish(), "");
    }

    #[test]
    fn false_start_of_a_stop_string_is_released() {
        let mut a = TextAssembler::new(vec!["END".into()]);
        assert_eq!(a.push(b"E").text, "");
        assert_eq!(a.push(b"X").text, "EX");
        assert_eq!(a.push(b"EN").text, "");
        assert_eq!(a.finish(), "EN");
    }

    #[test]
    fn earliest_stop_wins() {
        let mut a = TextAssembler::new(vec!["b".into(), "a".into()]);
        let d = a.push(b"xxabyy");
        assert_eq!(d.text, "xx");
        assert!(d.stopped);
    }

    #[test]
    fn text_from_the_hold_marker_on_is_held_to_the_end() {
        let mut a = TextAssembler::new(vec!["STOP".into()]).holding_from("<tool_call>");
        assert_eq!(a.push(b"Sure.\n<tool").text, "Sure.\n");
        assert_eq!(a.push(b"_call>\n{\"name\"").text, "");
        assert_eq!(a.push(b": 1}\n</tool_call>").text, "");
        assert_eq!(a.finish(), "<tool_call>\n{\"name\": 1}\n</tool_call>");
        // A false start is released; a stop string still ends the answer while holding.
        let mut a = TextAssembler::new(vec!["STOP".into()]).holding_from("<tool_call>");
        assert_eq!(a.push(b"a <tool").text, "a ");
        assert_eq!(a.push(b"box>").text, "<toolbox>");
        assert_eq!(a.push(b"<tool_call>xSTOPy").text, "<tool_call>x");
        assert_eq!(a.finish(), "");
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut a = TextAssembler::new(vec![]);
        assert_eq!(a.push(&[0xff, b'a']).text, "\u{fffd}a");
    }
}
