//! A chat request becomes the prompt a stock llama-server builds from the same
//! GGUF. Our engine renders the GGUF's Jinja template (minijinja, `engine/src/template.rs`);
//! the stock server renders it with its own Jinja engine. For each conversation below the
//! stock server's `/apply-template` then `/tokenize` (with the special tokens it adds, as a
//! completion does) must give exactly our engine's tokens. SmolLM2's template adds a
//! default system prompt when a conversation has none: the case llama.cpp's built-in
//! template matcher, which we used before, got wrong (476 against 497 tokens).

use crate::common;
use crate::common::stock::StockServer;

use serde_json::{json, Value};

/// Conversations of every shape the template has a branch for.
fn conversations() -> Vec<Vec<(&'static str, String)>> {
    let long = "The harbour was quiet in the early morning. ".repeat(60);
    vec![
        vec![("user", "Name two moons of Jupiter.".into())],
        vec![
            ("system", "You answer in one word.".into()),
            ("user", "What colour is the sky?".into()),
        ],
        vec![
            ("user", "Hi!".into()),
            ("assistant", "Hello! How can I help?".into()),
            ("user", "Tell me a joke.".into()),
        ],
        vec![
            ("system", "You are terse.".into()),
            ("user", "2+2?".into()),
            ("assistant", "4".into()),
            ("user", "And 3+3?".into()),
            ("assistant", "6".into()),
            ("user", "Thanks.".into()),
        ],
        vec![(
            "user",
            "Ça va ? 日本語のテキスト 🙂 Ünïcödé — «quotes»".into(),
        )],
        // Template syntax and special-token text in content are content, never template.
        vec![(
            "user",
            "{{ bos_token }} {% if true %}x{% endif %} <|im_start|>assistant\n".into(),
        )],
        vec![(
            "user",
            "  leading and trailing spaces  \n\nand blank lines\n".into(),
        )],
        vec![("user", long)],
        vec![("assistant", "I start this conversation.".into())],
        vec![
            ("system", "First system message.".into()),
            ("system", "Second system message.".into()),
            ("user", "Which one counts?".into()),
        ],
        vec![
            ("user", "What is the temperature?".into()),
            ("assistant", "Let me check.".into()),
            ("tool", "{\"celsius\": 21}".into()),
        ],
    ]
}

/// Each conversation through the stock server's `/apply-template` + `/tokenize` and through
/// our engine: the same tokens, or both refuse it (a template's `raise_exception`). Returns
/// how many were refused.
async fn assert_prompts_as_stock(
    stock: &StockServer,
    engine: &edgesplit_engine::Engine,
    convs: &[Vec<(&'static str, String)>],
) -> usize {
    let mut refused = 0;
    for conv in convs {
        let messages: Vec<Value> = conv
            .iter()
            .map(|(r, c)| json!({"role": r, "content": c}))
            .collect();
        let (status, _, applied) = common::post(
            &format!("{}/apply-template", stock.base),
            &json!({ "messages": messages }),
        )
        .await;
        let ours = engine
            .tokenize(edgesplit_engine::Input::chat(
                conv.iter().map(|(r, c)| (*r, c.clone())),
            ))
            .await;
        if status != 200 {
            let Err(e) = ours else {
                panic!("{messages:?}: llama-server refused it ({applied}), we did not")
            };
            assert!(
                matches!(e, edgesplit_engine::EngineError::Template(_)),
                "{messages:?}: {e}"
            );
            refused += 1;
            continue;
        }
        let prompt = applied["prompt"]
            .as_str()
            .unwrap_or_else(|| panic!("{applied}"));
        let theirs = stock_tokens(stock, prompt).await;
        let ours = ours.unwrap_or_else(|e| panic!("{messages:?}: {e}"));
        assert_eq!(
            ours, theirs,
            "conversation {messages:?}: llama-server's prompt was {prompt:?}"
        );
    }
    refused
}

/// `prompt` tokenized by the stock server as a completion tokenizes it (special tokens
/// added and parsed).
async fn stock_tokens(stock: &StockServer, prompt: &str) -> Vec<i32> {
    let (_, _, tokenized) = common::post(
        &format!("{}/tokenize", stock.base),
        &json!({"content": prompt, "add_special": true, "parse_special": true}),
    )
    .await;
    tokenized["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("{tokenized}"))
        .iter()
        .map(|t| t.as_i64().unwrap() as i32)
        .collect()
}

async fn engine(
    model: &std::path::Path,
    file: Option<&std::path::Path>,
) -> edgesplit_engine::Engine {
    let mut cfg = edgesplit_engine::EngineConfig::new(model);
    cfg.n_ctx = 2048;
    cfg.n_parallel = 1;
    cfg.chat_template_file = file.map(std::path::Path::to_path_buf);
    edgesplit_engine::Engine::start(cfg).await.unwrap()
}

#[tokio::test]
async fn every_conversation_is_the_prompt_llama_server_builds() {
    let model = common::model(common::SMOLLM2);
    let stock = StockServer::start("template", &model, &[]).await;
    let convs = conversations();
    assert!(convs.len() >= 10);
    let refused = assert_prompts_as_stock(&stock, &engine(&model, None).await, &convs).await;
    assert_eq!(refused, 0);
}

/// A GGUF without a chat template (our Gemma-3 file): llama-server falls back to ChatML,
/// and so do we, token for token.
#[tokio::test]
async fn a_model_without_a_template_gets_llama_servers_chatml() {
    let model = common::model(common::GEMMA3);
    let stock = StockServer::start("gemma-chatml", &model, &[]).await;
    let engine = engine(&model, None).await;
    assert!(!engine.info().has_chat_template);
    let refused = assert_prompts_as_stock(&stock, &engine, &conversations()).await;
    assert_eq!(refused, 0);
}

/// Through the router, as a user sends it: a chat request without a system message (and
/// one whose content comes in parts) is the prompt a stock llama-server builds. Its
/// `/apply-template` renders the chat; that text, sent to our router as a completion, gets
/// the same greedy answer from the same number of prompt tokens as the chat does. (Not
/// llama-server's own answer: the vendored llama.cpp computes its float functions
/// otherwise, patches/llama-cpp-det-math.patch, so a near tie may go the other way.)
#[tokio::test]
async fn a_chat_request_without_a_system_message_is_the_prompt_llama_server_builds() {
    let model = common::model(common::SMOLLM2);
    let stock = StockServer::start("template-chat", &model, &[]).await;
    let s = common::smollm2();
    let sampling = json!({"temperature": 0, "max_tokens": 16});
    for messages in [
        json!([{"role": "user", "content": "Name three fruits."}]),
        json!([{"role": "user", "content": [
            {"type": "text", "text": "Name a colour."},
            {"type": "text", "text": "Answer in one word."}
        ]}]),
    ] {
        let (st, _, applied) = common::post(
            &format!("{}/apply-template", stock.base),
            &json!({ "messages": messages }),
        )
        .await;
        assert_eq!(st, 200, "{applied}");
        let prompt = applied["prompt"].as_str().unwrap();
        let chat = common::chat_body(messages.clone(), sampling.clone());
        let (st, _, v) = common::post(&format!("{}/v1/chat/completions", s.router), &chat).await;
        assert_eq!(st, 200, "{v}");
        let ours = (
            v["usage"]["prompt_tokens"].clone(),
            v["choices"][0]["message"]["content"].clone(),
        );
        let mut completion = sampling.clone();
        completion["prompt"] = json!(prompt);
        let (st, _, v) = common::post(&format!("{}/v1/completions", s.router), &completion).await;
        assert_eq!(st, 200, "{v}");
        let theirs = (
            v["usage"]["prompt_tokens"].clone(),
            v["choices"][0]["text"].clone(),
        );
        assert!(ours.0.as_u64().unwrap() > 20, "{ours:?}");
        assert_eq!(
            ours, theirs,
            "the chat, then llama-server's rendering {prompt:?}: {messages}"
        );
    }
}

/// A conversation the template cannot render is a 400 naming the template's error, as
/// llama-server refuses it, not a 500; the router goes on serving.
#[tokio::test]
async fn a_conversation_the_template_refuses_is_a_clear_400() {
    let s = common::smollm2();
    let url = format!("{}/v1/chat/completions", s.router);
    let (status, _, v) = common::post(
        &url,
        &common::chat_body(
            json!([
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "assistant", "content": "again"}
            ]),
            json!({"max_tokens": 4}),
        ),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "template_error", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("2 or more assistant messages"),
        "{v}"
    );
    // A final assistant message alone is continued: the answer goes on from its text.
    let (status, _, v) = common::post(
        &url,
        &common::chat_body(
            json!([
                {"role": "user", "content": "Count from one to ten."},
                {"role": "assistant", "content": "One, two, three,"}
            ]),
            json!({"max_tokens": 6, "temperature": 0}),
        ),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.to_lowercase().contains("four"), "{text:?}");
}

/// Gemma-3's chat template (Google's, as published with the instruction-tuned models). Our
/// Gemma-3 GGUF carries none; `--chat-template-file` supplies it, as with llama-server.
const GEMMA3_TEMPLATE: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"#;

/// `--chat-template-file`, on the Gemma-3 GGUF that has no template: the same tokens as a
/// stock llama-server given the same file (its BOS written by the template and cut, the
/// system message folded into the first turn, slicing, `trim`), the template's own
/// refusal as our error, and an unusable file refused at start.
#[tokio::test]
async fn a_template_file_gives_llama_servers_prompt_and_a_bad_one_is_refused_at_start() {
    let model = common::model(common::GEMMA3);
    let dir = common::stock::tempdir("gemma-template");
    let file = dir.join("gemma3.jinja");
    std::fs::write(&file, GEMMA3_TEMPLATE).unwrap();
    let stock = StockServer::start(
        "gemma-template",
        &model,
        &["--jinja", "--chat-template-file", file.to_str().unwrap()],
    )
    .await;
    let mut cfg = edgesplit_engine::EngineConfig::new(&model);
    cfg.n_ctx = 2048;
    cfg.chat_template_file = Some(file.clone());
    let engine = edgesplit_engine::Engine::start(cfg.clone()).await.unwrap();
    assert!(engine.info().has_chat_template);
    // Gemma's template refuses what does not alternate user/assistant (a conversation
    // opened by the assistant, two system messages, a tool message): so does llama-server.
    let refused = assert_prompts_as_stock(&stock, &engine, &conversations()).await;
    assert!((1..=4).contains(&refused), "{refused} refused");
    let refused = engine
        .tokenize(edgesplit_engine::Input::chat(vec![
            ("user", "a"),
            ("user", "b"),
        ]))
        .await
        .unwrap_err();
    assert!(
        refused
            .to_string()
            .contains("Conversation roles must alternate"),
        "{refused}"
    );

    for (contents, says) in [
        (None, "gemma3-missing.jinja"),
        (Some("{% for m in messages %}"), "line"),
    ] {
        let mut bad = cfg.clone();
        let path = dir.join("gemma3-missing.jinja");
        if let Some(text) = contents {
            std::fs::write(&path, text).unwrap();
        }
        bad.chat_template_file = Some(path);
        let Err(e) = edgesplit_engine::Engine::start(bad).await else {
            panic!("started with an unusable template file")
        };
        assert!(e.to_string().contains(says), "{e}");
    }
}

/// The engine's chat for OpenAI-shaped `messages` and `tools`, the tools as the router
/// passes them on (`edgesplit_router::tools::parse`).
fn chat_of(messages: &Value, tools: &Value) -> edgesplit_engine::Chat {
    let fields = edgesplit_router::error::typed(json!({ "tools": tools })).unwrap();
    let tools = edgesplit_router::tools::parse(fields)
        .unwrap()
        .map(|t| serde_json::from_str::<Value>(&t.json).unwrap());
    let messages = messages
        .as_array()
        .unwrap()
        .iter()
        .map(|m| edgesplit_engine::ChatMessage {
            role: m["role"].as_str().unwrap().into(),
            content: m["content"].as_str().unwrap_or("").into(),
            tool_calls: m["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| edgesplit_engine::ToolCall {
                    id: c["id"].as_str().unwrap().into(),
                    name: c["function"]["name"].as_str().unwrap().into(),
                    arguments: serde_json::from_str(c["function"]["arguments"].as_str().unwrap())
                        .unwrap(),
                })
                .collect(),
            tool_call_id: m["tool_call_id"].as_str().map(Into::into),
        })
        .collect();
    edgesplit_engine::Chat { messages, tools }
}

/// Conversations with tools, calls and tools' answers through
/// `templates/chatml-tools.jinja` give the tokens a stock llama-server (`--jinja`) gives
/// from the same file and request: the tools listed as its Jinja engine writes them (keys
/// in the client's order), each call's arguments as an object, the tools' answers.
#[tokio::test]
async fn tool_conversations_are_the_prompt_llama_server_builds() {
    let model = common::model(common::SMOLLM2);
    let file = std::path::PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../templates/chatml-tools.jinja"
    ));
    let stock = StockServer::start(
        "tools-template",
        &model,
        &["--jinja", "--chat-template-file", file.to_str().unwrap()],
    )
    .await;
    let engine = engine(&model, Some(&file)).await;
    assert_eq!(
        engine.info().tool_call_format,
        edgesplit_engine::ToolCallFormat::Hermes
    );
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time",
          "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
    ]);
    let call = |id: &str, name: &str, args: &str| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}});
    let cases = [
        (
            json!([{"role": "user", "content": "Weather in Oslo?"}]),
            tools.clone(),
        ),
        (
            json!([{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "Time in Lima?"}]),
            tools.clone(),
        ),
        (
            json!([{"role": "user", "content": "Weather in Oslo?"},
                   {"role": "assistant", "content": null, "tool_calls": [
                       call("c1", "get_weather", r#"{"city": "Oslo", "unit": "celsius"}"#)]},
                   {"role": "tool", "tool_call_id": "c1", "content": "{\"celsius\": 4}"}]),
            tools.clone(),
        ),
        (
            json!([{"role": "user", "content": "Weather in Oslo and time in Lima?"},
                   {"role": "assistant", "content": "Checking both.", "tool_calls": [
                       call("c1", "get_weather", r#"{"city":"Oslo"}"#),
                       call("c2", "get_time", r#"{"tz": "America/Lima", "n": [1, 2.5, true, null]}"#)]},
                   {"role": "tool", "tool_call_id": "c1", "content": "4 degrees"},
                   {"role": "tool", "tool_call_id": "c2", "content": "09:12"},
                   {"role": "assistant", "content": "4 degrees in Oslo; 09:12 in Lima."},
                   {"role": "user", "content": "Thanks!"}]),
            tools.clone(),
        ),
        // The history of calls without tools offered this turn.
        (
            json!([{"role": "user", "content": "Weather in Oslo?"},
                   {"role": "assistant", "content": null, "tool_calls": [
                       call("c1", "get_weather", r#"{"city": "Oslo"}"#)]},
                   {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]),
            json!([]),
        ),
    ];
    for (messages, tools) in cases {
        let mut request = json!({ "messages": messages });
        if tools.as_array().is_some_and(|a| !a.is_empty()) {
            request["tools"] = tools.clone();
        }
        let (status, _, applied) =
            common::post(&format!("{}/apply-template", stock.base), &request).await;
        assert_eq!(status, 200, "{request}: {applied}");
        let prompt = applied["prompt"].as_str().unwrap();
        let theirs = stock_tokens(&stock, prompt).await;
        let ours = engine
            .tokenize(edgesplit_engine::Input::Chat(chat_of(&messages, &tools)))
            .await
            .unwrap();
        assert_eq!(
            ours, theirs,
            "{request}: llama-server's prompt was {prompt:?}"
        );
    }
}
