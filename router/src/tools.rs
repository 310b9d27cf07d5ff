//! Tool calls (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`): the request's
//! side, checked once, and the answer's side, the calls read from the model's text.
//!
//! The tools reach the model through its chat template (the nodes render them, as
//! llama-server does), and the model writes its calls in the template's format. The one
//! format parsed here is Hermes's, which Hermes 2 Pro, Qwen 2.5 and SmolLM3 templates
//! (and `templates/chatml-tools.jinja`) teach: `<tool_call>\n{"name": ..., "arguments":
//! {...}}\n</tool_call>`, one block per call. A model whose template takes no tools, or
//! writes them otherwise, gets a 400 (the router reads the format from the prefill
//! node's `Info`).
//!
//! - `tool_choice: "auto"` (the default with tools): the model writes what it likes; the
//!   answer's text is read for calls at its end (a text that is not only calls after its
//!   first `<tool_call>` is an ordinary answer, as llama-server treats it).
//! - `"required"` or a named function: the answer is sampled within a grammar of calls
//!   (llama.cpp's grammar sampler, like `response_format`), so it is always a call, to
//!   one of the tools (or the named one) with arguments that follow its `parameters`.
//! - `"none"`: the tools are not rendered and nothing is read for calls.
//! - `parallel_tool_calls` (default true): more than one call may come; false: one (the
//!   grammar's when forced; with `auto`, the first call the model wrote).

use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::error::{refuse_other, ApiError};

/// Where a call starts in the model's text (what streamed text is held back from).
pub const MARKER: &str = "<tool_call>";
const END: &str = "</tool_call>";
/// Most tools a request may carry (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// Which calls the answer may or must make.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    Auto,
    Required,
    /// This function, by name.
    Function(String),
}

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    pub name: String,
    pub description: String,
    /// Its `parameters` JSON Schema as given (None: none).
    pub parameters: Option<Value>,
}

/// A request's tools, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// The tools as the chat template is given them: as llama-server passes them, each
    /// `{"type": "function", "function": {"name", "description", "parameters"}}` in that
    /// order, an absent description `""` and absent parameters `{}` (so that the prompt
    /// is llama-server's, token for token).
    pub json: String,
    pub functions: Vec<Function>,
    pub choice: ToolChoice,
    pub parallel: bool,
}

/// A function call: from the model's text (in a response) or from an assistant message
/// (in a request). `arguments` is JSON text of an object.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

fn invalid(param: impl Into<String>, msg: impl Into<String>) -> ApiError {
    ApiError::invalid(Some(param.into()), msg)
}

/// The one kind of tool and call there is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FunctionKind {
    Function,
}

/// `tools[i]` as it arrives: `{"type": "function", "function": {...}}`.
#[derive(Debug, Deserialize)]
pub struct ToolBody {
    #[serde(rename = "type")]
    kind: FunctionKind,
    function: Option<FunctionBody>,
    #[serde(flatten)]
    other: Map<String, Value>,
}

/// `tools[i].function`: `{"name", "description", "parameters", "strict"}`.
#[derive(Debug, Deserialize)]
struct FunctionBody {
    name: Option<String>,
    description: Option<String>,
    /// A JSON Schema.
    parameters: Option<Map<String, Value>>,
    /// Accepted: calls are always held to the parameters when forced.
    #[allow(dead_code)]
    strict: Option<bool>,
    #[serde(flatten)]
    other: Map<String, Value>,
}

/// `tool_choice` as it arrives: `"none" | "auto" | "required"` or a named function.
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "tool_choice must be \"none\", \"auto\", \"required\" or a named function"
)]
pub enum ToolChoiceBody {
    Mode(String),
    Named(NamedChoice),
}

/// `{"type": "function", "function": {"name": ...}}`.
#[derive(Debug, Deserialize)]
pub struct NamedChoice {
    #[serde(rename = "type")]
    kind: FunctionKind,
    function: ChoiceName,
    #[serde(flatten)]
    other: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
struct ChoiceName {
    name: String,
    #[serde(flatten)]
    other: Map<String, Value>,
}

/// A request's `tools`, `tool_choice` and `parallel_tool_calls` as they arrived.
#[derive(Debug, Default, Deserialize)]
pub struct ToolFields {
    pub tools: Option<Vec<ToolBody>>,
    pub tool_choice: Option<ToolChoiceBody>,
    pub parallel_tool_calls: Option<bool>,
}

/// OpenAI's rule for function names.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// One `tools[i]` entry.
fn function(i: usize, tool: ToolBody) -> Result<Function, ApiError> {
    let param = format!("tools[{i}]");
    refuse_other(&tool.other, &param)?;
    let FunctionKind::Function = tool.kind;
    let param = format!("{param}.function");
    let Some(f) = tool.function else {
        return Err(invalid(param, "a function tool needs a function object"));
    };
    refuse_other(&f.other, &param)?;
    let name = match f.name {
        Some(n) if valid_name(&n) => n,
        _ => {
            return Err(invalid(
                format!("{param}.name"),
                "a function's name is required: 1-64 letters, digits, '_' or '-'",
            ))
        }
    };
    Ok(Function {
        name,
        description: f.description.unwrap_or_default(),
        parameters: f.parameters.map(Value::Object),
    })
}

/// `tools`, `tool_choice` and `parallel_tool_calls`. None: no tools, or `tool_choice:
/// "none"` (the answer is text and the template renders no tools).
///
/// # Errors
/// A 400 naming the field.
pub fn parse(fields: ToolFields) -> Result<Option<Tools>, ApiError> {
    let list = fields.tools.unwrap_or_default();
    if list.len() > MAX_TOOLS {
        return Err(invalid(
            "tools",
            format!("tools must be an array of at most {MAX_TOOLS} tools"),
        ));
    }
    let mut functions: Vec<Function> = Vec::with_capacity(list.len());
    for (i, t) in list.into_iter().enumerate() {
        let f = function(i, t)?;
        if functions.iter().any(|g| g.name == f.name) {
            return Err(invalid(
                format!("tools[{i}].function.name"),
                format!("two tools are named {:?}", f.name),
            ));
        }
        functions.push(f);
    }
    let parallel = fields.parallel_tool_calls.unwrap_or(true);
    let choice = match fields.tool_choice {
        None => None,
        Some(ToolChoiceBody::Mode(s)) => match s.as_str() {
            "none" => return Ok(None),
            "auto" => Some(ToolChoice::Auto),
            "required" => Some(ToolChoice::Required),
            _ => {
                return Err(invalid(
                    "tool_choice",
                    "tool_choice must be \"none\", \"auto\", \"required\" or a named function",
                ))
            }
        },
        Some(ToolChoiceBody::Named(n)) => {
            refuse_other(&n.other, "tool_choice")?;
            refuse_other(&n.function.other, "tool_choice.function")?;
            let FunctionKind::Function = n.kind;
            let name = n.function.name;
            if !functions.iter().any(|f| f.name == name) {
                return Err(invalid(
                    "tool_choice.function.name",
                    format!("no tool is named {name:?}"),
                ));
            }
            Some(ToolChoice::Function(name))
        }
    };
    if functions.is_empty() {
        return match choice {
            None => Ok(None),
            Some(_) => Err(invalid("tool_choice", "tool_choice needs tools")),
        };
    }
    let json: Vec<Value> = functions
        .iter()
        .map(|f| {
            json!({"type": "function", "function": {"name": f.name, "description": f.description,
                "parameters": f.parameters.clone().unwrap_or_else(|| json!({}))}})
        })
        .collect();
    Ok(Some(Tools {
        json: Value::Array(json).to_string(),
        functions,
        choice: choice.unwrap_or(ToolChoice::Auto),
        parallel,
    }))
}

impl Tools {
    /// The JSON Schema every forced call follows (`{"name": <a tool's>, "arguments":
    /// <its parameters>}`), or None when the model chooses (`auto`).
    #[must_use]
    pub fn forced_schema(&self) -> Option<String> {
        let one = |f: &Function| {
            json!({"type": "object",
                "properties": {"name": {"const": f.name},
                    "arguments": f.parameters.clone().unwrap_or_else(|| json!({"type": "object"}))},
                "required": ["name", "arguments"], "additionalProperties": false})
        };
        let schema = match &self.choice {
            ToolChoice::Auto => return None,
            ToolChoice::Function(n) => one(self.functions.iter().find(|f| &f.name == n)?),
            ToolChoice::Required if self.functions.len() == 1 => one(&self.functions[0]),
            ToolChoice::Required => {
                json!({"anyOf": self.functions.iter().map(one).collect::<Vec<_>>()})
            }
        };
        Some(schema.to_string())
    }

    /// The calls in an answer's `text`, with the text before them; None when the text
    /// after its first `<tool_call>` is not only well-formed calls to these tools (it is
    /// then an ordinary answer). Ids are new (`call_...`).
    #[must_use]
    pub fn calls_in<'t>(&self, text: &'t str) -> Option<(&'t str, Vec<Call>)> {
        let at = text.find(MARKER)?;
        let mut rest = &text[at..];
        let mut calls = Vec::new();
        while !rest.trim_start().is_empty() {
            let body = rest.trim_start().strip_prefix(MARKER)?;
            let end = body.find(END)?;
            calls.push(self.call(&body[..end])?);
            rest = &body[end + END.len()..];
        }
        if !self.parallel {
            calls.truncate(1);
        }
        Some((&text[..at], calls))
    }

    /// One call's JSON: `{"name": <a tool's>, "arguments": {...}}` (arguments may also be
    /// a string holding the object, as some models write them).
    fn call(&self, json: &str) -> Option<Call> {
        let v: Value = serde_json::from_str(json.trim()).ok()?;
        let name = v.get("name")?.as_str()?;
        if !self.functions.iter().any(|f| f.name == name) {
            return None;
        }
        let arguments = match v.get("arguments") {
            None => json!({}),
            Some(Value::String(s)) => serde_json::from_str(s).ok()?,
            Some(a) => a.clone(),
        };
        if !arguments.is_object() {
            return None;
        }
        Some(Call {
            id: format!("call_{}", &uuid::Uuid::new_v4().simple().to_string()[..24]),
            name: name.to_string(),
            arguments: arguments.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(extra: Value) -> Result<Option<Tools>, ApiError> {
        let mut body = json!({"tools": [
            {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "get_time"}}
        ]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        read(body)
    }

    /// `body`'s tool fields, read as a request's are.
    fn read(body: Value) -> Result<Option<Tools>, ApiError> {
        parse(crate::error::typed(body)?)
    }

    fn param(r: Result<Option<Tools>, ApiError>) -> String {
        r.unwrap_err().param.unwrap_or_default()
    }

    #[test]
    fn tools_and_choices_are_read() {
        let t = tools(json!({})).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Auto);
        assert!(t.parallel);
        assert_eq!(t.functions[1].parameters, None);
        assert!(t.json.starts_with(r#"[{"type":"function","function":{"name":"get_weather","description":"Weather.","parameters""#));
        assert!(
            t.json
                .ends_with(r#"{"name":"get_time","description":"","parameters":{}}}]"#),
            "{}",
            t.json
        );
        assert_eq!(t.forced_schema(), None);
        let t = tools(
            json!({"tool_choice": {"type": "function", "function": {"name": "get_time"}},
                             "parallel_tool_calls": false}),
        )
        .unwrap()
        .unwrap();
        assert_eq!(t.choice, ToolChoice::Function("get_time".into()));
        assert!(!t.parallel);
        let s: Value = serde_json::from_str(&t.forced_schema().unwrap()).unwrap();
        assert_eq!(s["properties"]["name"]["const"], "get_time");
        let t = tools(json!({"tool_choice": "required"})).unwrap().unwrap();
        let s: Value = serde_json::from_str(&t.forced_schema().unwrap()).unwrap();
        assert_eq!(s["anyOf"].as_array().unwrap().len(), 2);
        assert_eq!(tools(json!({"tool_choice": "none"})).unwrap(), None);
        assert_eq!(read(json!({"tool_choice": "none"})).unwrap(), None);
    }

    #[test]
    fn malformed_tools_are_refused_by_name() {
        let bad = |body: Value| param(read(body));
        assert_eq!(bad(json!({"tools": {}})), "tools");
        assert_eq!(bad(json!({"tools": [1]})), "tools[0]");
        assert_eq!(
            bad(json!({"tools": [{"type": "code_interpreter"}]})),
            "tools[0].type"
        );
        assert_eq!(
            bad(json!({"tools": [{"type": "function", "function": {"name": "a b"}}]})),
            "tools[0].function.name"
        );
        assert_eq!(
            bad(json!({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]})),
            "tools[0].function.extra"
        );
        assert_eq!(
            bad(
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]})
            ),
            "tools[0].function.parameters"
        );
        assert_eq!(
            bad(
                json!({"tools": [{"type": "function", "function": {"name": "f"}},
                                 {"type": "function", "function": {"name": "f"}}]})
            ),
            "tools[1].function.name"
        );
        assert_eq!(bad(json!({"tool_choice": "auto"})), "tool_choice");
        assert_eq!(
            param(tools(json!({"tool_choice": "sometimes"}))),
            "tool_choice"
        );
        assert_eq!(
            param(tools(
                json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}})
            )),
            "tool_choice.function.name"
        );
        assert_eq!(
            param(tools(json!({"parallel_tool_calls": "yes"}))),
            "parallel_tool_calls"
        );
        let many: Vec<Value> = (0..=MAX_TOOLS)
            .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
            .collect();
        assert_eq!(bad(json!({ "tools": many })), "tools");
    }

    #[test]
    fn calls_are_read_from_hermes_blocks() {
        let t = tools(json!({})).unwrap().unwrap();
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{}\"}\n</tool_call>\n";
        let (content, calls) = t.calls_in(text).unwrap();
        assert_eq!(content, "Let me look.\n");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, r#"{"city":"Paris"}"#);
        assert_eq!(calls[1].arguments, "{}");
        assert!(calls[0].id.starts_with("call_") && calls[0].id != calls[1].id);
        let one = Tools {
            parallel: false,
            ..t.clone()
        };
        assert_eq!(one.calls_in(text).unwrap().1.len(), 1);
        let only = "<tool_call>\n{\"name\": \"get_time\"}\n</tool_call>";
        assert_eq!(t.calls_in(only).unwrap().0, "");
    }

    #[test]
    fn text_that_is_not_only_calls_is_an_answer() {
        let t = tools(json!({})).unwrap().unwrap();
        for text in [
            "No calls here.",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par",
            "<tool_call>\n{\"name\": \"unknown\", \"arguments\": {}}\n</tool_call>",
            "<tool_call>\nnot json\n</tool_call>",
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": [1]}\n</tool_call>",
            "<tool_call>\n{\"name\": \"get_time\"}\n</tool_call> and then some words",
        ] {
            assert_eq!(t.calls_in(text), None, "{text}");
        }
    }
}
