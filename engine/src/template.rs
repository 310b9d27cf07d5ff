//! The model's own chat template (`tokenizer.chat_template` in the GGUF), rendered the way
//! llama-server renders it, so that a chat request becomes the same prompt on both.
//!
//! llama-server (its `--jinja` path, the default) renders the template with a Jinja engine
//! and these variables: `messages` (each `{role, content}`, plus `tool_calls` on an
//! assistant message that called tools, each `{id, type: "function", function: {name,
//! arguments}}` with the arguments as an object, and `tool_call_id` on a `tool` message),
//! `tools` (the request's, when it has any), `bos_token` and `eos_token`
//! (the vocabulary's BOS and EOS as text), `add_generation_prompt` (true for a chat
//! request), `enable_thinking` (true), and the functions `raise_exception` and
//! `strftime_now`; blocks are trimmed (`trim_blocks`, `lstrip_blocks`, as Hugging Face's
//! `apply_chat_template` does). Then, where the vocabulary adds BOS itself, a BOS the
//! template wrote at the start is cut (tokenizing adds it back once), and likewise a
//! trailing EOS where the vocabulary adds EOS. We do the same with minijinja, plus its
//! Python-compatible string and dict methods (`.strip()`, `.startswith()`, `.items()`...)
//! and loop controls, which chat templates use, and a `tojson` that writes JSON the way
//! Python's `json.dumps` does (`", "` and `": "`, no HTML escaping).
//!
//! A template is operator input (it comes with the model file) but rendering runs over
//! client input, so each render has a fuel budget: a template that loops without end fails
//! with an error instead of holding the engine thread.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};

use crate::types::{Chat, ChatMessage};

/// The template for a GGUF without one: llama-server's fallback (`CHATML_TEMPLATE_SRC` in
/// llama.cpp's common/chat.cpp), so that such a model answers a chat request with the
/// prompt llama-server gives it. ChatML may not be the format the model was trained on:
/// `--chat-template-file` gives it its own.
pub const CHATML_FALLBACK: &str = r"{%- for message in messages -%}
  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
{%- endif -%}";

/// Fuel for one render: minijinja counts instructions; real chat templates use a few
/// thousand per message.
const FUEL: u64 = 50_000_000;

/// A compiled chat template with the vocabulary facts its rendering needs.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    /// The vocabulary adds BOS when tokenizing: a leading BOS in the text is cut.
    strip_bos: bool,
    /// The vocabulary adds EOS when tokenizing: a trailing EOS in the text is cut.
    strip_eos: bool,
    tool_calls: ToolCallFormat,
    /// SHA-256 (hex) of the template's source.
    fingerprint: String,
}

/// How a chat template writes the model's tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// The template renders no tools.
    None,
    /// JSON in `<tool_call>` tags (Hermes 2 Pro, Qwen 2.5, SmolLM3 ...): the format the
    /// router parses and forced calls are sampled in.
    Hermes,
    /// The template renders tools, but its calls are in a format we do not parse.
    Other,
}

impl ToolCallFormat {
    /// The name `Info` reports (`tool_call_format`).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            ToolCallFormat::None => "",
            ToolCallFormat::Hermes => "hermes",
            ToolCallFormat::Other => "other",
        }
    }
}

/// The text of the model's BOS and EOS tokens, and whether tokenizing adds them.
pub struct SpecialTokens {
    pub bos: String,
    pub eos: String,
    pub add_bos: bool,
    pub add_eos: bool,
}

impl ChatTemplate {
    /// Compiles `source`. The error is the template's syntax error, with its line.
    pub fn new(source: &str, special: SpecialTokens) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| describe(&e))?,
        );
        env.set_fuel(Some(FUEL));
        // As llama.cpp's Jinja engine: a member or index of an undefined value is
        // undefined, not an error (Gemma's template reads `messages[0]['role']` of a
        // conversation that, once its final assistant message is cut off, is empty).
        env.set_undefined_behavior(minijinja::UndefinedBehavior::Chainable);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source.to_owned())
            .map_err(|e| describe(&e))?;
        let mut t = ChatTemplate {
            env,
            bos: special.bos,
            eos: special.eos,
            strip_bos: special.add_bos,
            strip_eos: special.add_eos,
            tool_calls: ToolCallFormat::None,
            fingerprint: {
                use sha2::Digest;
                hex::encode(sha2::Sha256::digest(source.as_bytes()))
            },
        };
        t.tool_calls = t.probe_tools(source);
        Ok(t)
    }

    /// SHA-256 (hex) of the template's source: two nodes render a chat alike when theirs
    /// are equal.
    #[must_use]
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// How this template writes tool calls (see [`ToolCallFormat`]).
    #[must_use]
    pub fn tool_call_format(&self) -> ToolCallFormat {
        self.tool_calls
    }

    /// Whether the template renders tools at all (as llama.cpp finds out: a tool's name in
    /// the prompt of a conversation given one), and if so in which format it calls them.
    fn probe_tools(&self, source: &str) -> ToolCallFormat {
        const NAME: &str = "edgesplit_probe_tool";
        let chat = Chat {
            messages: vec![ChatMessage {
                role: "user".into(),
                content: "x".into(),
                ..ChatMessage::default()
            }],
            tools: Some(serde_json::json!([{"type": "function", "function": {
                "name": NAME, "description": "A tool.",
                "parameters": {"type": "object", "properties": {}}}}])),
        };
        match self.render_turns(&chat, &chat.messages, true) {
            Ok(text) if text.contains(NAME) && source.contains("<tool_call>") => {
                ToolCallFormat::Hermes
            }
            Ok(text) if text.contains(NAME) => ToolCallFormat::Other,
            _ => ToolCallFormat::None,
        }
    }

    /// The prompt for `chat`: ending with the assistant's turn, or, when the last message
    /// is the assistant's, ending with that message's content for the model to continue
    /// (llama-server's "assistant prefill": the conversation before it, then the
    /// template's generation prompt, then the content).
    pub fn render(&self, chat: &Chat) -> Result<String, String> {
        let messages = &chat.messages;
        let is_assistant = |m: Option<&ChatMessage>| m.is_some_and(|m| m.role == "assistant");
        let Some((last, head)) = messages.split_last().filter(|(l, _)| is_assistant(Some(l)))
        else {
            return self.render_turns(chat, messages, true);
        };
        if is_assistant(head.last()) {
            return Err("Cannot have 2 or more assistant messages at the end of the list.".into());
        }
        // The generation prompt is what rendering with it adds to rendering without it.
        let without = self.render_turns(chat, head, false)?;
        let with = self.render_turns(chat, head, true)?;
        let common = without
            .bytes()
            .zip(with.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        let mut text = without.into_bytes();
        text.extend_from_slice(&with.as_bytes()[common..]);
        text.extend_from_slice(last.content.as_bytes());
        Ok(String::from_utf8_lossy(&text).into_owned())
    }

    /// The template over `messages` (of `chat`, whose tools it is given), with or without
    /// the generation prompt, with a BOS or EOS that tokenizing adds anyway cut.
    fn render_turns(
        &self,
        chat: &Chat,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let messages: Vec<Value> = messages.iter().map(message_value).collect();
        let ctx = minijinja::context! {
            messages => messages,
            tools => chat.tools.clone().map(json_value),
            bos_token => self.bos.as_str(),
            eos_token => self.eos.as_str(),
            add_generation_prompt => add_generation_prompt,
            enable_thinking => true,
        };
        let tmpl = self.env.get_template("chat").map_err(|e| describe(&e))?;
        let mut text = tmpl.render(ctx).map_err(|e| describe(&e))?;
        if self.strip_bos && !self.bos.is_empty() && text.starts_with(&self.bos) {
            text.drain(..self.bos.len());
        }
        if self.strip_eos && !self.eos.is_empty() && text.ends_with(&self.eos) {
            text.truncate(text.len() - self.eos.len());
        }
        Ok(text)
    }
}

/// A message as templates read it: `{role, content}`, with `tool_calls` (OpenAI's shape,
/// arguments as an object, which templates write with `tojson`) and a null content when an
/// assistant message only calls tools, and `tool_call_id` on a tool's answer.
fn message_value(m: &ChatMessage) -> Value {
    let mut v = serde_json::json!({"role": m.role, "content": m.content});
    if !m.tool_calls.is_empty() {
        if m.content.is_empty() {
            v["content"] = serde_json::Value::Null;
        }
        v["tool_calls"] = m
            .tool_calls
            .iter()
            .map(|c| {
                serde_json::json!({"id": c.id, "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments}})
            })
            .collect();
    }
    if let Some(id) = &m.tool_call_id {
        v["tool_call_id"] = serde_json::json!(id);
    }
    json_value(v)
}

/// A JSON value as a template value (maps keep their order).
fn json_value(v: serde_json::Value) -> Value {
    serde_json::from_value(v).unwrap_or_default()
}

/// An error with its cause chain and, where known, the template line.
fn describe(e: &Error) -> String {
    let mut s = match e.line() {
        Some(line) => format!("{e} (template line {line})"),
        None => e.to_string(),
    };
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        s.push_str(&format!(": {c}"));
        cause = c.source();
    }
    s
}

/// `raise_exception(message)`: the template refuses the conversation (for example a role
/// order it does not support); the message reaches the client in the 400.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the local time, formatted as C's `strftime` does.
fn strftime_now(format: String) -> Result<Value, Error> {
    let now = jiff::ZonedDateTime::now();
    jiff::fmt::strtime::format(format.as_bytes(), &now)
        .map(Value::from)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))
}

/// `value | tojson(indent=None)`: JSON as Python's `json.dumps(value, ensure_ascii=False,
/// indent=indent)` writes it (keys in their order, `", "` and `": "`), which is what the
/// templates were written against.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    python_json(&value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn python_json(
    v: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    use minijinja::value::ValueKind as K;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    // Python's separators: ", " between items without indent, "," with it; ": " always.
    let item_sep = if indent.is_some() { "," } else { ", " };
    let quote = |s: &str| serde_json::Value::String(s.to_owned()).to_string();
    match v.kind() {
        K::Undefined | K::None => out.push_str("null"),
        K::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        K::Number => out.push_str(&v.to_string()),
        K::String => out.push_str(&quote(v.as_str().unwrap_or_default())),
        K::Seq | K::Iterable | K::Map => {
            // (key, value) for a map's entries, (None, item) for a list's.
            let is_map = v.kind() == K::Map;
            let entries = v
                .try_iter()?
                .map(|x| {
                    if is_map {
                        Ok((Some(x.to_string()), v.get_item(&x)?))
                    } else {
                        Ok((None, x))
                    }
                })
                .collect::<Result<Vec<_>, Error>>()?;
            out.push(if is_map { '{' } else { '[' });
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                if let Some(k) = key {
                    out.push_str(&quote(k));
                    out.push_str(": ");
                }
                python_json(item, indent, depth + 1, out)?;
            }
            if !entries.is_empty() {
                newline(out, depth);
            }
            out.push(if is_map { '}' } else { ']' });
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a {}", v.kind()),
            ))
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn special(add_bos: bool) -> SpecialTokens {
        SpecialTokens {
            bos: "<s>".into(),
            eos: "</s>".into(),
            add_bos,
            add_eos: false,
        }
    }

    fn msgs(list: &[(&str, &str)]) -> Chat {
        match crate::Input::chat(list.iter().copied()) {
            crate::Input::Chat(c) => c,
            crate::Input::Raw(_) => unreachable!(),
        }
    }

    #[test]
    fn renders_with_trimmed_blocks_and_python_methods() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}\n  {% if m['role'] == 'user' %}\n[{{ m['content'].strip() | upper }}]\n  {% endif %}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}",
            special(false),
        )
        .unwrap();
        let out = t
            .render(&msgs(&[("user", "  hi "), ("system", "x")]))
            .unwrap();
        assert_eq!(out, "<s>[HI]\n>");
    }

    #[test]
    fn a_leading_bos_is_cut_when_the_vocabulary_adds_it() {
        let src = "{{ bos_token }}{{ messages[0]['content'] }}";
        let one = msgs(&[("user", "a")]);
        assert_eq!(
            ChatTemplate::new(src, special(true))
                .unwrap()
                .render(&one)
                .unwrap(),
            "a"
        );
        assert_eq!(
            ChatTemplate::new(src, special(false))
                .unwrap()
                .render(&one)
                .unwrap(),
            "<s>a"
        );
    }

    #[test]
    fn a_final_assistant_message_is_continued() {
        let t = ChatTemplate::new(
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
            special(false),
        )
        .unwrap();
        let conv = msgs(&[("user", "hi"), ("assistant", "Hel")]);
        assert_eq!(t.render(&conv).unwrap(), "<user>hi</><assistant>Hel");
        let two = msgs(&[("user", "hi"), ("assistant", "a"), ("assistant", "b")]);
        assert!(t.render(&two).unwrap_err().contains("2 or more assistant"));
    }

    #[test]
    fn raise_exception_and_syntax_errors_are_reported() {
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with a user turn') }}{% endif %}",
            special(false),
        )
        .unwrap();
        let e = t.render(&msgs(&[("system", "x")])).unwrap_err();
        assert!(
            e.contains("Conversations must start with a user turn"),
            "{e}"
        );
        let e = ChatTemplate::new("{% for m in messages %}", special(false))
            .err()
            .unwrap();
        assert!(e.contains("line"), "{e}");
    }

    #[test]
    fn a_template_that_never_ends_runs_out_of_fuel() {
        let t = ChatTemplate::new(
            "{% for a in range(10000) %}{% for b in range(10000) %}{% for c in range(10000) %}x{% endfor %}{% endfor %}{% endfor %}",
            special(false),
        )
        .unwrap();
        let e = t.render(&msgs(&[("user", "x")])).unwrap_err();
        assert!(e.to_lowercase().contains("fuel"), "{e}");
    }

    #[test]
    fn tojson_writes_what_python_writes() {
        let t = ChatTemplate::new(
            "{{ {'a': [1, 'é<'], 'b': {}} | tojson }}|{{ {'a': [1]} | tojson(indent=2) }}",
            special(false),
        )
        .unwrap();
        assert_eq!(
            t.render(&Chat::default()).unwrap(),
            "{\"a\": [1, \"é<\"], \"b\": {}}|{\n  \"a\": [\n    1\n  ]\n}"
        );
    }

    #[test]
    fn tools_and_calls_render_and_the_format_is_found() {
        let t = ChatTemplate::new(
            include_str!("../../templates/chatml-tools.jinja"),
            special(false),
        )
        .unwrap();
        assert_eq!(t.tool_call_format(), ToolCallFormat::Hermes);
        let chat = Chat {
            messages: vec![
                ChatMessage {
                    role: "user".into(),
                    content: "Time?".into(),
                    ..ChatMessage::default()
                },
                ChatMessage {
                    role: "assistant".into(),
                    tool_calls: vec![crate::ToolCall {
                        id: "c1".into(),
                        name: "get_time".into(),
                        arguments: serde_json::json!({"tz": "UTC", "a": 1}),
                    }],
                    ..ChatMessage::default()
                },
                ChatMessage {
                    role: "tool".into(),
                    content: "12:00".into(),
                    tool_call_id: Some("c1".into()),
                    ..ChatMessage::default()
                },
            ],
            tools: Some(serde_json::json!([{"type": "function",
                "function": {"name": "get_time", "parameters": {"type": "object"}}}])),
        };
        let text = t.render(&chat).unwrap();
        // The tools as Python's json.dumps writes them (keys in the client's order), the
        // call's arguments likewise, the tool's answer in a user turn.
        assert!(text.contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_time\", \"parameters\": {\"type\": \"object\"}}}\n</tools>"), "{text}");
        assert!(text.contains("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\", \"a\": 1}}\n</tool_call><|im_end|>"), "{text}");
        assert!(text.ends_with("<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n"), "{text}");
        // Without tools, plain ChatML.
        let plain = t.render(&msgs(&[("user", "hi")])).unwrap();
        assert_eq!(
            plain,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        // A template that renders tools but not as <tool_call> JSON, and one without any.
        let other = ChatTemplate::new(
            "{% for t in tools %}{{ t.function.name }}{% endfor %}{{ messages[0].content }}",
            special(false),
        )
        .unwrap();
        assert_eq!(other.tool_call_format(), ToolCallFormat::Other);
        let none = ChatTemplate::new(CHATML_FALLBACK, special(false)).unwrap();
        assert_eq!(none.tool_call_format(), ToolCallFormat::None);
    }
}
