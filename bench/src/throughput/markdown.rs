//! The run's summary in Markdown: the table of cells and what each cell's answers say.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::*;

fn f(x: Option<f64>, digits: usize) -> String {
    x.map_or("-".into(), |x| format!("{x:.digits$}"))
}

/// `auto`'s choices of a cell, most chosen first ("local 19, phone 9"); `-` for none.
pub(super) fn choices_text(choices: &BTreeMap<String, usize>) -> String {
    let mut v: Vec<(&String, &usize)> = choices.iter().collect();
    v.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    if v.is_empty() {
        return "-".into();
    }
    v.iter()
        .map(|(m, n)| format!("{m} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

pub(super) fn markdown(
    command: &str,
    devices: &str,
    args: &ThroughputArgs,
    mix: &[(usize, u32)],
    cells: &[Cell],
) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## EdgeSplit throughput\n\n`{command}`\n\n{devices}. {} requests per cell from a mix of {} \
         (prompt tokens, answer tokens) in this order: {mix:?}. Closed-loop clients; temperature \
         0; every answer compared with the same request written alone on `local`.\n",
        args.requests,
        mix.len()
    );
    if args.turns > 1 {
        let _ = writeln!(
            md,
            "{}",
            crate::turns::header(args.turns, args.turn_tokens, args.fresh)
        );
    }
    let _ = writeln!(
        md,
        "| link | clients | mode | done | failed | wrong | fallbacks | req/min | vs local | first {FIRST}: req/min | vs local | TTFT p50 / p95 ms | e2e p50 / p95 ms | phone share of tokens | laptop CPU ms / request | vs local | auto's choices | actual / predicted p50 / p90 |"
    );
    let _ = writeln!(
        md,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let local: BTreeMap<(&str, usize), &Cell> = cells
        .iter()
        .filter(|c| c.mode == "local")
        .map(|c| ((c.profile.as_str(), c.clients), c))
        .collect();
    for c in cells {
        let base = local.get(&(c.profile.as_str(), c.clients));
        let rpm_ratio = base.map(|b| c.requests_per_min / b.requests_per_min);
        let first_ratio =
            base.and_then(|b| Some(c.first_requests_per_min? / b.first_requests_per_min?));
        let cpu_ratio =
            base.and_then(|b| Some(c.laptop_cpu_ms_per_request? / b.laptop_cpu_ms_per_request?));
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {:.2} | {} | {} | {} | {} / {} | {} / {} | {} | {} | {} | {} | {} / {} |",
            c.profile,
            c.clients,
            c.mode,
            c.completed,
            c.failed,
            c.wrong,
            c.fallbacks,
            c.requests_per_min,
            f(rpm_ratio, 2),
            f(c.first_requests_per_min, 2),
            f(first_ratio, 2),
            f(c.ttft_p50_ms, 0),
            f(c.ttft_p95_ms, 0),
            f(c.e2e_p50_ms, 0),
            f(c.e2e_p95_ms, 0),
            f(c.phone_share, 2),
            f(c.laptop_cpu_ms_per_request, 0),
            f(cpu_ratio, 2),
            choices_text(&c.choices),
            f(c.actual_over_predicted_p50, 2),
            f(c.actual_over_predicted_p90, 2),
        );
    }
    for c in cells.iter().filter(|c| c.node_tokens.len() > 1) {
        let shares: Vec<String> = c
            .node_tokens
            .iter()
            .map(|(node, t)| format!("{node} {t}"))
            .collect();
        let _ = writeln!(
            md,
            "\n{} x{} {}: answer tokens by decode node: {}",
            c.profile,
            c.clients,
            c.mode,
            shares.join(", ")
        );
    }
    for c in cells.iter().filter(|c| !c.order.is_empty()) {
        let _ = writeln!(
            md,
            "\n{} x{} {}: modes in request order: {}",
            c.profile,
            c.clients,
            c.mode,
            c.order.join(" ")
        );
        if let Some(x) = c.e2e_over_local_max {
            let _ = writeln!(
                md,
                "{} x{} {}: from the second request on, the largest e2e over the same request's alone on local: {x:.2}",
                c.profile, c.clients, c.mode
            );
        }
    }
    for (c, t) in cells.iter().filter_map(|c| Some((c, c.turns.as_ref()?))) {
        let _ = writeln!(
            md,
            "\n{} x{} {}: {}",
            c.profile,
            c.clients,
            c.mode,
            t.line()
        );
    }
    if !args.phone_speed_at.is_empty() {
        let _ = writeln!(
            md,
            "\nThe phone's speed changed as request I started (I:speed): {:?}",
            args.phone_speed_at
        );
    }
    for c in cells.iter().filter(|c| !c.wrong_answers.is_empty()) {
        let _ = writeln!(
            md,
            "\n{} x{} {}: answers that differ from the same request's alone on local: {}",
            c.profile,
            c.clients,
            c.mode,
            c.wrong_answers.join("; ")
        );
    }
    for c in cells.iter().filter(|c| !c.errors.is_empty()) {
        let _ = writeln!(
            md,
            "\n{} x{} {}: first error: {}",
            c.profile, c.clients, c.mode, c.errors[0]
        );
    }
    md
}
