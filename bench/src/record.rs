//! The durable record: a SQLite file the user keeps. Every attempt is a row written
//! *before* its request starts (`status = 'started'`) and completed after (`ok` or
//! `failed`), so a crash mid-run stays visible as started-never-finished. Warm-ups are
//! marked `excluded`, never deleted. Each summary row names the attempt ids it came from.

use std::path::Path;

use rusqlite::{params, Connection};
use serde_json::{Map, Value};

use crate::client::Measure;
use crate::stats::{percentile, Line};
use edgesplit_bench::energy::Used;

/// The record's tables; the router's dashboard test reads the same file.
const SCHEMA: &str = include_str!("../schema.sql");

pub fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

pub struct Record {
    db: Connection,
    pub run_id: i64,
}

/// Where an attempt belongs.
#[derive(Clone, Debug)]
pub struct Slot<'a> {
    pub mode: &'a str,
    pub model: &'a str,
    pub profile: &'a str,
    pub transport: &'a str,
    pub target_prompt_tokens: usize,
    pub max_tokens: u32,
    pub pair: usize,
    pub position: usize,
    pub excluded: bool,
}

impl Record {
    pub fn open(path: &Path, command: &str, threads: i32, n_ctx: u32) -> anyhow::Result<Record> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let db = Connection::open(path)?;
        db.execute_batch(SCHEMA)?;
        // Records made before `out_dir` existed.
        let has_out_dir = db.prepare("SELECT out_dir FROM runs LIMIT 0").is_ok();
        if !has_out_dir {
            db.execute_batch("ALTER TABLE runs ADD COLUMN out_dir TEXT")?;
        }
        // Records made before the live handoff's columns existed.
        if db
            .prepare("SELECT switch_ms FROM attempts LIMIT 0")
            .is_err()
        {
            db.execute_batch(
                "ALTER TABLE attempts ADD COLUMN prefill_tokens INTEGER;
                 ALTER TABLE attempts ADD COLUMN switch_ms REAL;",
            )?;
        }
        // Records made before the device emulation's columns existed.
        if db
            .prepare("SELECT laptop_cpu_ms FROM attempts LIMIT 0")
            .is_err()
        {
            db.execute_batch(
                "ALTER TABLE attempts ADD COLUMN phone_tokens INTEGER;
                 ALTER TABLE attempts ADD COLUMN laptop_cpu_ms REAL;
                 ALTER TABLE attempts ADD COLUMN laptop_energy_j REAL;
                 ALTER TABLE attempts ADD COLUMN laptop_energy_note TEXT;
                 ALTER TABLE attempts ADD COLUMN phone_energy_j REAL;
                 ALTER TABLE attempts ADD COLUMN phone_energy_note TEXT;",
            )?;
        }
        // Records made before the import's column existed.
        if db
            .prepare("SELECT import_ms FROM attempts LIMIT 0")
            .is_err()
        {
            db.execute_batch("ALTER TABLE attempts ADD COLUMN import_ms REAL;")?;
        }
        let rev = std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
        db.execute(
            "INSERT INTO runs (started_at, command, git_rev, threads, n_ctx) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![now(), command, rev, threads, n_ctx],
        )?;
        let run_id = db.last_insert_rowid();
        Ok(Record { db, run_id })
    }

    /// Writes the row before the request starts; returns its id.
    pub fn begin(&self, s: &Slot) -> anyhow::Result<i64> {
        self.db.execute(
            "INSERT INTO attempts (run_id, mode, model, profile, transport, target_prompt_tokens,
                max_tokens, pair, position, excluded, started_at, status)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, 'started')",
            params![
                self.run_id,
                s.mode,
                s.model,
                s.profile,
                s.transport,
                s.target_prompt_tokens as i64,
                s.max_tokens,
                s.pair as i64,
                s.position as i64,
                s.excluded,
                now()
            ],
        )?;
        Ok(self.db.last_insert_rowid())
    }

    pub fn finish(
        &self,
        id: i64,
        result: &Result<Measure, String>,
        energy: &Result<f64, String>,
        used: &Used,
    ) -> anyhow::Result<()> {
        let split = |r: &Result<f64, String>| match r {
            Ok(j) => (Some(*j), None),
            Err(why) => (None, Some(why.clone())),
        };
        let (energy_j, energy_note) = split(energy);
        let (laptop_j, laptop_note) = split(&used.laptop_j);
        let (phone_j, phone_note) = split(&used.phone_j);
        self.db.execute(
            "UPDATE attempts SET laptop_energy_j = ?2, laptop_energy_note = ?3,
                phone_energy_j = ?4, phone_energy_note = ?5 WHERE id = ?1",
            params![id, laptop_j, laptop_note, phone_j, phone_note],
        )?;
        match result {
            Err(e) => {
                self.db.execute(
                    "UPDATE attempts SET finished_at = ?2, status = 'failed', error = ?3,
                        energy_j = ?4, energy_note = ?5 WHERE id = ?1",
                    params![id, now(), e, energy_j, energy_note],
                )?;
            }
            Ok(m) => {
                let mut itl = m.itl_ms.clone();
                itl.sort_by(f64::total_cmp);
                let itl_mean =
                    (!itl.is_empty()).then(|| itl.iter().sum::<f64>() / itl.len() as f64);
                let itl_p90 = (!itl.is_empty()).then(|| percentile(&itl, 0.9));
                self.db.execute(
                    "UPDATE attempts SET finished_at = ?2, status = 'ok', ttft_ms = ?3, tpot_ms = ?4,
                        itl_mean_ms = ?5, itl_p90_ms = ?6, itl_max_ms = ?7, itl_ms = ?8, e2e_ms = ?9,
                        prompt_tokens = ?10, completion_tokens = ?11, prefill_ms = ?12,
                        handoff_bytes = ?13, handoff_ms = ?14, decode_tps = ?15, energy_j = ?16,
                        energy_note = ?17, text_sha256 = ?18, prefill_tokens = ?19,
                        switch_ms = ?20, phone_tokens = ?21, laptop_cpu_ms = ?22,
                        import_ms = ?23 WHERE id = ?1",
                    params![
                        id,
                        now(),
                        m.ttft_ms,
                        m.tpot_ms,
                        itl_mean,
                        itl_p90,
                        itl.last().copied(),
                        serde_json::to_string(&m.itl_ms)?,
                        m.e2e_ms,
                        m.prompt_tokens as i64,
                        m.completion_tokens as i64,
                        m.prefill_ms,
                        m.handoff_bytes.map(|b| b as i64),
                        m.handoff_ms,
                        m.decode_tps,
                        energy_j,
                        energy_note,
                        hex_sha256(&m.text),
                        m.prefill_tokens.map(|n| n as i64),
                        m.switch_ms,
                        m.phone_tokens.map(|n| n as i64),
                        m.laptop_cpu_ms,
                        m.import_ms,
                    ],
                )?;
            }
        }
        Ok(())
    }

    pub fn mark_same(&self, id: i64, same: bool) -> anyhow::Result<()> {
        self.db.execute(
            "UPDATE attempts SET same_as_reference = ?2 WHERE id = ?1",
            params![id, same],
        )?;
        Ok(())
    }

    /// Stores summary lines, each with the attempt ids it came from.
    pub fn summaries(&self, lines: &[Line]) -> anyhow::Result<()> {
        for l in lines {
            let st = &l.stats;
            self.db.execute(
                "INSERT INTO summaries (run_id, model, profile, target_prompt_tokens, max_tokens,
                    subject, metric, n, mean, median, stddev, min, max, p90, attempt_ids)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)",
                params![
                    self.run_id,
                    l.model,
                    l.profile,
                    l.target_prompt_tokens as i64,
                    l.max_tokens,
                    l.subject,
                    l.metric,
                    st.n as i64,
                    st.mean,
                    st.median,
                    st.stddev,
                    st.min,
                    st.max,
                    st.p90,
                    serde_json::to_string(&l.attempt_ids)?,
                ],
            )?;
        }
        Ok(())
    }

    /// Where this run writes its outputs (absolute, so the router's dashboard finds them).
    pub fn set_out_dir(&self, dir: &Path) -> anyhow::Result<()> {
        let dir = std::fs::canonicalize(dir)?;
        self.db.execute(
            "UPDATE runs SET out_dir = ?2 WHERE id = ?1",
            params![self.run_id, dir.display().to_string()],
        )?;
        Ok(())
    }

    pub fn close_run(&self) -> anyhow::Result<()> {
        self.db.execute(
            "UPDATE runs SET finished_at = ?2 WHERE id = ?1",
            params![self.run_id, now()],
        )?;
        Ok(())
    }

    /// Every row of `table` for this run, as JSON objects in id order.
    pub fn rows(&self, table: &str) -> anyhow::Result<Vec<Map<String, Value>>> {
        anyhow::ensure!(matches!(table, "attempts" | "summaries"), "unknown table");
        let mut stmt = self.db.prepare(&format!(
            "SELECT * FROM {table} WHERE run_id = ?1 ORDER BY id"
        ))?;
        let names: Vec<String> = stmt.column_names().iter().map(|s| s.to_string()).collect();
        let rows = stmt.query_map([self.run_id], |row| {
            let mut m = Map::new();
            for (i, name) in names.iter().enumerate() {
                let v = match row.get_ref(i)? {
                    rusqlite::types::ValueRef::Null => Value::Null,
                    rusqlite::types::ValueRef::Integer(x) => Value::from(x),
                    rusqlite::types::ValueRef::Real(x) => Value::from(x),
                    rusqlite::types::ValueRef::Text(t) => {
                        Value::from(String::from_utf8_lossy(t).into_owned())
                    }
                    rusqlite::types::ValueRef::Blob(b) => Value::from(b.len()),
                };
                m.insert(name.clone(), v);
            }
            Ok(m)
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}

fn hex_sha256(s: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(s.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_started_row_stays_visible_until_finished() {
        let dir = std::env::temp_dir().join(format!("edgesplit-record-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let rec = Record::open(&dir.join("b.sqlite"), "test", 2, 2048).unwrap();
        let slot = Slot {
            mode: "pair",
            model: "m",
            profile: "loopback",
            transport: "v2",
            target_prompt_tokens: 16,
            max_tokens: 8,
            pair: 0,
            position: 0,
            excluded: true,
        };
        let a = rec.begin(&slot).unwrap();
        let b = rec.begin(&slot).unwrap();
        let used = Used {
            laptop_j: Err("no RAPL here".into()),
            phone_j: Ok(3.5),
        };
        rec.finish(a, &Err("boom".into()), &Err(power_na()), &used)
            .unwrap();
        let rows = rec.rows("attempts").unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0]["status"], "failed");
        assert_eq!(rows[0]["error"], "boom");
        // Energy: a figure, or NULL with the reason; never 0 for "none".
        assert!(rows[0]["laptop_energy_j"].is_null());
        assert_eq!(rows[0]["laptop_energy_note"], "no RAPL here");
        assert_eq!(rows[0]["phone_energy_j"], 3.5);
        assert!(rows[0]["phone_energy_note"].is_null());
        assert_eq!(rows[0]["excluded"], 1);
        assert_eq!(rows[1]["id"], b);
        assert_eq!(rows[1]["status"], "started");
        assert!(rows[1]["finished_at"].is_null());
    }

    /// A record made before the device emulation's columns is migrated when opened.
    #[test]
    fn an_older_record_gets_the_new_columns() {
        let dir = std::env::temp_dir().join(format!("edgesplit-rec-old-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("old.sqlite");
        // The attempts table ends at switch_ms; the newer columns go to a table of their own.
        let old = SCHEMA.replace(
            "    phone_tokens INTEGER,",
            "    unused INTEGER); CREATE TABLE unused_tail (phone_tokens INTEGER,",
        );
        assert_ne!(old, SCHEMA, "the schema still ends as this test expects");
        Connection::open(&path)
            .unwrap()
            .execute_batch(&old)
            .unwrap();
        let rec = Record::open(&path, "test", 1, 2048).unwrap();
        for col in [
            "phone_tokens",
            "laptop_cpu_ms",
            "laptop_energy_note",
            "phone_energy_j",
            "import_ms",
        ] {
            assert!(
                rec.db
                    .prepare(&format!("SELECT {col} FROM attempts LIMIT 0"))
                    .is_ok(),
                "{col}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn power_na() -> String {
        crate::power::NOT_AVAILABLE.to_string()
    }
}
