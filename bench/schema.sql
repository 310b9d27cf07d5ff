-- The bench's SQLite record. Written by bench/src/record.rs; read (read-only) by the
-- router's dashboard, whose test loads this file so that the two cannot drift apart.
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY,
    started_at REAL NOT NULL,      -- unix seconds
    finished_at REAL,
    command TEXT NOT NULL,
    git_rev TEXT,
    threads INTEGER,
    n_ctx INTEGER,
    out_dir TEXT                   -- where the run wrote summary.md, JSON, CSV and plots
);
CREATE TABLE IF NOT EXISTS attempts (
    id INTEGER PRIMARY KEY,
    run_id INTEGER NOT NULL REFERENCES runs(id),
    mode TEXT NOT NULL,            -- 'pair' or 'concurrency'
    model TEXT NOT NULL,
    profile TEXT NOT NULL,
    transport TEXT NOT NULL,       -- local, v1, v2, v2-live, v2-after or stock
    target_prompt_tokens INTEGER NOT NULL,
    max_tokens INTEGER NOT NULL,
    pair INTEGER NOT NULL,         -- pair index (0 = warm-up); concurrency: request index
    position INTEGER NOT NULL,     -- order within the pair; concurrency: client index
    excluded INTEGER NOT NULL,     -- 1 = warm-up
    started_at REAL NOT NULL,
    finished_at REAL,
    status TEXT NOT NULL,          -- started, ok, failed
    error TEXT,
    ttft_ms REAL, tpot_ms REAL, itl_mean_ms REAL, itl_p90_ms REAL, itl_max_ms REAL,
    itl_ms TEXT,                   -- JSON array, every gap
    e2e_ms REAL,
    prompt_tokens INTEGER, completion_tokens INTEGER,
    prefill_ms REAL, handoff_bytes INTEGER, handoff_ms REAL, decode_tps REAL,
    energy_j REAL,
    energy_note TEXT,              -- why energy_j is NULL
    text_sha256 TEXT,
    same_as_reference INTEGER,     -- answer equals the pair's first EdgeSplit transport's
    prefill_tokens INTEGER,        -- live handoff: answer tokens the prefill node wrote
    switch_ms REAL,                -- live handoff: ms from the request to the switch
    phone_tokens INTEGER,          -- answer tokens the decode node (the phone) wrote
    laptop_cpu_ms REAL,            -- the prefill node's CPU time for the request (NULL when requests overlapped)
    laptop_energy_j REAL,          -- RAPL package energy where the bench runs (NULL: see laptop_energy_note)
    laptop_energy_note TEXT,
    phone_energy_j REAL,           -- battery energy where the bench runs (NULL: see phone_energy_note)
    phone_energy_note TEXT,
    import_ms REAL                 -- the decode node's import of the state (a live handoff's: at the switch)
);
CREATE TABLE IF NOT EXISTS summaries (
    id INTEGER PRIMARY KEY,
    run_id INTEGER NOT NULL REFERENCES runs(id),
    model TEXT NOT NULL, profile TEXT NOT NULL,
    target_prompt_tokens INTEGER NOT NULL, max_tokens INTEGER NOT NULL,
    subject TEXT NOT NULL,         -- a transport, 'ratio A/B (pairwise)', or 'concurrency N'
    metric TEXT NOT NULL,
    n INTEGER NOT NULL,
    mean REAL, median REAL, stddev REAL, min REAL, max REAL, p90 REAL,
    attempt_ids TEXT NOT NULL      -- JSON array of attempts.id
);
