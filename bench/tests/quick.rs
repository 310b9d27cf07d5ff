//! The harness's smoke test: `edgesplit-bench run --quick --stock` against the real
//! services (started by the bench from `target/release`, so `cargo build --release --bins`
//! comes first, as scripts/test.sh does) and a stock llama-server, then checks that every
//! output exists and is well-formed and that the SQLite record is complete.

use std::collections::HashSet;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn png_size(path: &Path) -> (u32, u32) {
    let b = std::fs::read(path).unwrap();
    assert!(b.len() > 10_000, "{} is nearly empty", path.display());
    assert_eq!(
        &b[..8],
        b"\x89PNG\r\n\x1a\n",
        "{} is not a PNG",
        path.display()
    );
    assert_eq!(&b[12..16], b"IHDR");
    let be = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().unwrap());
    (be(16), be(20))
}

#[test]
fn quick_run_writes_every_output() {
    let dir = std::env::temp_dir().join(format!("edgesplit-bench-quick-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let db = dir.join("bench.sqlite");
    let out = dir.join("out");
    let run = Command::new(env!("CARGO_BIN_EXE_edgesplit-bench"))
        .args(["run", "--quick", "--stock", "--no-progress"])
        .arg("--db")
        .arg(&db)
        .arg("--out")
        .arg(&out)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    // The log goes to the test's output either way; on failure, its end is in the panic
    // message too, so that the cause shows next to the failure in a long CI log.
    let log = String::from_utf8_lossy(&run.stderr);
    eprint!("{log}");
    let tail: Vec<&str> = log.lines().rev().take(40).collect();
    assert!(
        run.status.success(),
        "edgesplit-bench run --quick failed ({}); the end of its log:\n{}",
        run.status,
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    );

    // Every attempt: recorded, finished, successful; warm-ups kept and marked.
    let samples: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(out.join("samples.json")).unwrap()).unwrap();
    // quick: 2 profiles x 2 prompts x 3 pairs x 4 targets, + 2 profiles x 3 transports x 4.
    assert_eq!(samples.len(), 2 * 2 * 3 * 4 + 2 * 3 * 4);
    for s in &samples {
        assert_eq!(s["status"], "ok", "{s}");
        assert!(s["finished_at"].as_f64().unwrap() >= s["started_at"].as_f64().unwrap());
        assert!(s["ttft_ms"].as_f64().unwrap() > 0.0);
        assert!(s["e2e_ms"].as_f64().unwrap() >= s["ttft_ms"].as_f64().unwrap());
        assert!(s["completion_tokens"].as_i64().unwrap() > 0);
        assert!(s["energy_note"].as_str().is_some() || s["energy_j"].as_f64().is_some());
        if s["mode"] == "pair" {
            // Temperature 0: every EdgeSplit transport gives the same text. The stock
            // server is another llama.cpp (pinned: llama-cpp-python 0.3.36's tree) whose
            // float functions are the C library's, where ours are not
            // (patches/llama-cpp-det-math.patch): its agreement is recorded, a measurement,
            // not our invariant.
            if s["transport"] == "stock" {
                assert!(s["same_as_reference"].is_i64(), "{s}");
            } else {
                assert_eq!(s["same_as_reference"], 1, "{s}");
            }
            assert_eq!(s["excluded"], i64::from(s["pair"] == 0));
        }
        if s["transport"] == "v1" || s["transport"] == "v2" {
            // `v2` is the live handoff (the router's default): an answer that ended
            // before its switch was written on the prefill node and sent no state.
            let on_prefill = s["prefill_tokens"] == s["completion_tokens"];
            assert!(
                s["handoff_bytes"].as_i64().is_some_and(|b| b > 0) || on_prefill,
                "{s}"
            );
        }
    }
    // ... but a bench whose split answers all stayed on the prefill node measured no split:
    // on loopback, every measured v2 answer reached the decode node (it switched, and the
    // prefill node wrote fewer tokens than the answer has).
    let reached = |s: &&Value| {
        s["switch_ms"].as_f64().is_some()
            && s["prefill_tokens"]
                .as_i64()
                .is_some_and(|p| p < s["completion_tokens"].as_i64().unwrap())
    };
    let v2_loopback: Vec<&Value> = samples
        .iter()
        .filter(|s| s["transport"] == "v2" && s["profile"] == "loopback" && s["excluded"] == 0)
        .collect();
    assert!(!v2_loopback.is_empty());
    for s in &v2_loopback {
        assert!(
            reached(s),
            "a v2 answer on loopback ended on the prefill node: {s}"
        );
    }
    let profiles: HashSet<&str> = samples
        .iter()
        .map(|s| s["profile"].as_str().unwrap())
        .collect();
    assert_eq!(profiles, HashSet::from(["loopback", "wifi"]));

    // The CSV has the same rows and columns.
    let mut csv = csv::Reader::from_path(out.join("samples.csv")).unwrap();
    let header: Vec<String> = csv.headers().unwrap().iter().map(String::from).collect();
    let keys: Vec<String> = samples[0].as_object().unwrap().keys().cloned().collect();
    assert_eq!(header, keys);
    assert_eq!(csv.records().count(), samples.len());

    // Every summary names attempts that exist; warm-ups never count.
    let ids: HashSet<i64> = samples
        .iter()
        .filter(|s| s["excluded"] == 0)
        .map(|s| s["id"].as_i64().unwrap())
        .collect();
    let summary: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert!(!summary.is_empty());
    for l in &summary {
        let from: Vec<i64> = serde_json::from_str(l["attempt_ids"].as_str().unwrap()).unwrap();
        assert!(!from.is_empty());
        assert!(from.iter().all(|i| ids.contains(i)), "{l}");
    }
    let subjects: HashSet<&str> = summary
        .iter()
        .map(|l| l["subject"].as_str().unwrap())
        .collect();
    for s in [
        "ratio v2/local",
        "ratio v1/local",
        "ratio v2/stock",
        "v2 x2",
    ] {
        assert!(subjects.contains(s), "no {s} summary");
    }

    // The Markdown summary and the plots.
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    for s in [
        "| prompt tok | out tok | transport |",
        "link `wifi` (25 ms ± 5 one way, 100 Mbit/s)",
        "| 128 | v2 / stock |",
        "### Concurrency",
    ] {
        assert!(md.contains(s), "summary.md lacks {s:?}:\n{md}");
    }
    for p in [
        "ttft_vs_prompt.png",
        "decode_tps.png",
        "handoff_bytes.png",
        "token_gaps.png",
    ] {
        assert_eq!(png_size(&out.join(p)), (900, 560));
    }

    // The record itself: the run closed, no attempt left started.
    let conn = rusqlite::Connection::open(&db).unwrap();
    let open: i64 = conn
        .query_row(
            "SELECT COUNT(*) FROM attempts WHERE status = 'started' OR finished_at IS NULL",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(open, 0);
    let finished: Option<f64> = conn
        .query_row("SELECT finished_at FROM runs", [], |r| r.get(0))
        .unwrap();
    assert!(finished.is_some());
}

/// `edgesplit-bench handoff`, one counted round on a short prompt: every path measured,
/// our parts reported, the totals and ratios written. (The figures themselves are in
/// docs/BENCHMARKS.md; here only that the harness measures what it says it measures.)
#[test]
fn the_handoff_bench_measures_every_path() {
    let out = std::env::temp_dir().join(format!("edgesplit-bench-handoff-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let run = Command::new(env!("CARGO_BIN_EXE_edgesplit-bench"))
        .args(["handoff", "--rounds", "1", "--prompt-tokens", "300"])
        .arg("--out")
        .arg(&out)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&run.stderr);
    eprint!("{log}");
    let tail: Vec<&str> = log.lines().rev().take(40).collect();
    assert!(
        run.status.success(),
        "edgesplit-bench handoff failed ({}); the end of its log:\n{}",
        run.status,
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    );
    let samples: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(out.join("samples.json")).unwrap()).unwrap();
    // One counted round (the warm-up is not kept), three paths.
    assert_eq!(samples.len(), 3, "{samples:?}");
    let by = |p: &str| samples.iter().find(|s| s["path"] == p).unwrap();
    let parts = |s: &Value| -> Vec<(String, f64)> {
        s["parts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_str().unwrap().to_string(), p[1].as_f64().unwrap()))
            .collect()
    };
    let original = by("original");
    let names: Vec<String> = parts(original).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["save", "upload", "restore"]);
    // Ours: every part reported (V1 has no connect of its own), and the total is the sum
    // of the serial ones.
    for path in ["v1", "v2"] {
        let s = by(path);
        let p = parts(s);
        let get = |n: &str| p.iter().find(|(k, _)| k == n).map(|(_, v)| *v).unwrap();
        for n in [
            "export",
            "send (connect to ACK)",
            "receive",
            "of which verify",
            "import",
        ] {
            assert!(get(n) > 0.0, "{path} {n}: {s}");
        }
        let total = get("export") + get("send (connect to ACK)") + get("import");
        assert!(
            (s["total_ms"].as_f64().unwrap() - total).abs() < 1e-6,
            "{s}"
        );
    }
    // The same state crosses on every path: ours and the original's, within the file
    // header's few bytes and llama.cpp versions' format differences (v3 vs v4).
    let bytes = |p: &str| by(p)["bytes"].as_f64().unwrap();
    assert!((bytes("v1") - bytes("v2")).abs() / bytes("v2") < 0.01);
    assert!((bytes("original") - bytes("v2")).abs() / bytes("v2") < 0.05);
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    for want in ["v1 / original", "v2 / original", "GB/s"] {
        assert!(md.contains(want), "{want} missing:\n{md}");
    }
}
