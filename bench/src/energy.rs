//! Energy where the hardware tells it, per request; `None` with the reason where it does
//! not (never 0):
//! - a laptop's CPU package: Linux RAPL, `/sys/class/powercap/intel-rapl:N/energy_uj`
//!   (cumulative microjoules per package, wrapping at `max_energy_range_uj`), read before
//!   and after;
//! - a phone's battery: `/sys/class/power_supply/<battery>/current_now` x `voltage_now`,
//!   sampled every 100 ms and integrated. Units differ between devices: current in
//!   microamps with either sign (the magnitude is used), voltage in microvolts or, on some,
//!   millivolts (a value under 100,000 is read as millivolts). A physically impossible
//!   reading (over [`MAX_AMPS`], or a voltage outside 1-20 V) is flagged and dropped, not
//!   averaged in - the original project's old phone reported over 100 A.
//!
//! Both read the machine the bench runs on, under a root path (`/` here; a fake tree in
//! the tests): the laptop's figure is real where the bench runs on the laptop; the phone's
//! only where the bench runs on the phone. NVIDIA GPUs are read by [`crate`]'s caller with
//! nvidia-smi.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Currents above this are not a phone's battery: flagged and dropped.
pub const MAX_AMPS: f64 = 20.0;
/// Battery sampling period.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// RAPL package zones: their `energy_uj` and wrap-around range.
#[derive(Debug)]
pub struct Rapl {
    zones: Vec<(PathBuf, u64)>,
}

impl Rapl {
    /// The package zones under `root` (`intel-rapl:N`, not their sub-zones
    /// `intel-rapl:N:M`, which the package already counts), or why there are none.
    pub fn find(root: &Path) -> Result<Rapl, String> {
        let dir = root.join("sys/class/powercap");
        let entries =
            std::fs::read_dir(&dir).map_err(|e| format!("no RAPL: {} ({e})", dir.display()))?;
        let mut zones = Vec::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix("intel-rapl:") else {
                continue;
            };
            if rest.contains(':') {
                continue;
            }
            let p = e.path();
            let max = read_u64(&p.join("max_energy_range_uj"));
            match (read_u64(&p.join("energy_uj")), max) {
                (Some(_), Some(max)) if max > 0 => zones.push((p.join("energy_uj"), max)),
                _ => {
                    return Err(format!(
                        "RAPL zone {} unreadable (energy_uj needs root on recent kernels)",
                        p.display()
                    ))
                }
            }
        }
        zones.sort();
        if zones.is_empty() {
            return Err(format!("no RAPL package zone under {}", dir.display()));
        }
        Ok(Rapl { zones })
    }

    /// Each zone's counter now.
    #[must_use]
    pub fn read(&self) -> Option<Vec<u64>> {
        self.zones.iter().map(|(p, _)| read_u64(p)).collect()
    }

    /// Joules between two readings, across a wrap-around of each counter.
    #[must_use]
    pub fn joules(&self, before: &[u64], after: &[u64]) -> f64 {
        self.zones
            .iter()
            .zip(before.iter().zip(after))
            .map(|((_, max), (&b, &a))| {
                let uj = if a >= b { a - b } else { max - b + a };
                uj as f64 / 1e6
            })
            .sum()
    }
}

fn read_u64(p: &Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

fn read_f64(p: &Path) -> Option<f64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// A battery's power now, in watts, or why the reading is refused.
fn battery_watts(dir: &Path) -> Result<f64, String> {
    let (Some(ua), Some(v_raw)) = (
        read_f64(&dir.join("current_now")),
        read_f64(&dir.join("voltage_now")),
    ) else {
        return Err("no reading".into());
    };
    let amps = ua.abs() / 1e6;
    let volts = if v_raw.abs() < 100_000.0 {
        v_raw.abs() / 1e3
    } else {
        v_raw.abs() / 1e6
    };
    if amps > MAX_AMPS {
        return Err(format!("impossible current {amps:.1} A"));
    }
    if !(1.0..=20.0).contains(&volts) {
        return Err(format!("impossible voltage {volts:.2} V"));
    }
    Ok(amps * volts)
}

/// The first battery under `root` (`type` says `Battery`), or why there is none.
pub fn find_battery(root: &Path) -> Result<PathBuf, String> {
    let dir = root.join("sys/class/power_supply");
    let entries =
        std::fs::read_dir(&dir).map_err(|e| format!("no battery: {} ({e})", dir.display()))?;
    let mut found: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            std::fs::read_to_string(p.join("type")).is_ok_and(|t| t.trim() == "Battery")
                && p.join("current_now").is_file()
        })
        .collect();
    found.sort();
    found
        .into_iter()
        .next()
        .ok_or_else(|| format!("no battery with current_now under {}", dir.display()))
}

/// Samples a battery's power while a request runs.
pub struct BatterySampler {
    samples: Arc<Mutex<Samples>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct Samples {
    good: Vec<(Instant, f64)>,
    /// Readings refused as impossible, with the first reason.
    flagged: usize,
    why: Option<String>,
}

impl BatterySampler {
    /// Starts sampling the battery at `dir` every [`SAMPLE_EVERY`].
    #[must_use]
    pub fn start(dir: PathBuf) -> BatterySampler {
        let samples: Arc<Mutex<Samples>> = Arc::default();
        let s = samples.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(SAMPLE_EVERY);
            loop {
                tick.tick().await;
                let r = battery_watts(&dir);
                let mut s = s.lock().expect("samples");
                match r {
                    Ok(w) => s.good.push((Instant::now(), w)),
                    Err(why) => {
                        s.flagged += 1;
                        s.why.get_or_insert(why);
                    }
                }
            }
        });
        BatterySampler { samples, task }
    }

    /// Stops; joules over the good samples (the trapezoid rule), or why there are none. A
    /// reading flagged as impossible is left out and named in the reason when too few
    /// good ones remain.
    pub fn stop(self) -> Result<f64, String> {
        self.task.abort();
        let s = self.samples.lock().expect("samples");
        integrate(&s.good).ok_or_else(|| match &s.why {
            Some(why) => format!(
                "fewer than two good battery readings ({} dropped: {why})",
                s.flagged
            ),
            None => "fewer than two battery readings".into(),
        })
    }
}

/// Joules from (time, watts) samples by the trapezoid rule; `None` under two samples.
#[must_use]
pub fn integrate(samples: &[(Instant, f64)]) -> Option<f64> {
    (samples.len() >= 2).then(|| {
        samples
            .windows(2)
            .map(|w| (w[1].0 - w[0].0).as_secs_f64() * (w[0].1 + w[1].1) / 2.0)
            .sum()
    })
}

/// A request's laptop and phone energy readers, started before it and stopped after.
pub struct Meter {
    rapl: Result<(Arc<Rapl>, Vec<u64>), String>,
    battery: Result<BatterySampler, String>,
}

/// What one request used, or why not.
#[derive(Debug, Clone, PartialEq)]
pub struct Used {
    pub laptop_j: Result<f64, String>,
    pub phone_j: Result<f64, String>,
}

/// The readers found once under a root.
pub struct Sensors {
    rapl: Result<Arc<Rapl>, String>,
    battery: Result<PathBuf, String>,
}

impl Sensors {
    #[must_use]
    pub fn find(root: &Path) -> Sensors {
        Sensors {
            rapl: Rapl::find(root).map(Arc::new),
            battery: find_battery(root),
        }
    }

    /// Starts measuring one request.
    #[must_use]
    pub fn start(&self) -> Meter {
        Meter {
            rapl: self.rapl.clone().and_then(|r| {
                let before = r.read().ok_or("RAPL unreadable")?;
                Ok((r, before))
            }),
            battery: self.battery.clone().map(BatterySampler::start),
        }
    }
}

impl Meter {
    #[must_use]
    pub fn stop(self) -> Used {
        Used {
            laptop_j: self.rapl.and_then(|(r, before)| {
                let after = r.read().ok_or("RAPL unreadable")?;
                Ok(r.joules(&before, &after))
            }),
            phone_j: self.battery.and_then(BatterySampler::stop),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(tag: &str) -> PathBuf {
        let root =
            std::env::temp_dir().join(format!("edgesplit-sysfs-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        root
    }

    fn put(root: &Path, rel: &str, value: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, value).unwrap();
    }

    #[test]
    fn rapl_reads_packages_only_and_survives_a_wrap() {
        let root = tree("rapl");
        put(
            &root,
            "sys/class/powercap/intel-rapl:0/energy_uj",
            "999000000\n",
        );
        put(
            &root,
            "sys/class/powercap/intel-rapl:0/max_energy_range_uj",
            "1000000000\n",
        );
        // A sub-zone (the package counts it already) and another kind of zone.
        put(&root, "sys/class/powercap/intel-rapl:0:0/energy_uj", "5");
        put(
            &root,
            "sys/class/powercap/intel-rapl:0:0/max_energy_range_uj",
            "10",
        );
        put(&root, "sys/class/powercap/dtpm/energy_uj", "5");
        let r = Rapl::find(&root).unwrap();
        assert_eq!(r.zones.len(), 1);
        let before = r.read().unwrap();
        // 1.5 J later, across the wrap at 1,000 J.
        put(
            &root,
            "sys/class/powercap/intel-rapl:0/energy_uj",
            "500000\n",
        );
        let after = r.read().unwrap();
        assert!((r.joules(&before, &after) - 1.5).abs() < 1e-9);
        // Without a wrap.
        assert!((r.joules(&[100], &[2_100_100]) - 2.1).abs() < 1e-9);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn no_rapl_and_no_battery_say_so() {
        let root = tree("none");
        std::fs::create_dir_all(&root).unwrap();
        let s = Sensors::find(&root);
        assert!(s.rapl.as_ref().unwrap_err().contains("no RAPL"));
        assert!(s.battery.as_ref().unwrap_err().contains("no battery"));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn battery_units_and_impossible_readings() {
        let root = tree("bat");
        let b = root.join("sys/class/power_supply/battery");
        put(&root, "sys/class/power_supply/battery/type", "Battery\n");
        put(&root, "sys/class/power_supply/usb/type", "USB\n");
        // Microamps (negative while discharging on this vendor), microvolts.
        put(
            &root,
            "sys/class/power_supply/battery/current_now",
            "-2000000",
        );
        put(
            &root,
            "sys/class/power_supply/battery/voltage_now",
            "4000000",
        );
        assert_eq!(find_battery(&root).unwrap(), b);
        assert!((battery_watts(&b).unwrap() - 8.0).abs() < 1e-9);
        // Millivolts on some devices.
        put(&root, "sys/class/power_supply/battery/voltage_now", "4000");
        assert!((battery_watts(&b).unwrap() - 8.0).abs() < 1e-9);
        // Over 20 A (the old phone's 100 A): refused.
        put(
            &root,
            "sys/class/power_supply/battery/current_now",
            "100000000",
        );
        let e = battery_watts(&b).unwrap_err();
        assert!(e.contains("impossible current"), "{e}");
        put(
            &root,
            "sys/class/power_supply/battery/current_now",
            "1000000",
        );
        put(
            &root,
            "sys/class/power_supply/battery/voltage_now",
            "90000000",
        );
        assert!(battery_watts(&b)
            .unwrap_err()
            .contains("impossible voltage"));
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// Impossible samples in the middle of a request are dropped, not averaged in: the
    /// energy is that of the good ones.
    #[tokio::test]
    async fn a_sampler_drops_impossible_readings() {
        let root = tree("sampler");
        let b = root.join("sys/class/power_supply/bms");
        put(&root, "sys/class/power_supply/bms/type", "Battery");
        put(&root, "sys/class/power_supply/bms/current_now", "1000000");
        put(&root, "sys/class/power_supply/bms/voltage_now", "4000000");
        let s = BatterySampler::start(b.clone());
        tokio::time::sleep(Duration::from_millis(350)).await;
        put(&root, "sys/class/power_supply/bms/current_now", "150000000");
        tokio::time::sleep(Duration::from_millis(250)).await;
        put(&root, "sys/class/power_supply/bms/current_now", "1000000");
        tokio::time::sleep(Duration::from_millis(350)).await;
        let flagged = s.samples.lock().unwrap().flagged;
        let j = s.stop().unwrap();
        assert!(flagged >= 1, "the 150 A readings were flagged");
        // 4 W over about 0.95 s: had a 600 W reading been averaged in, far more.
        assert!(j > 2.0 && j < 4.5, "{j} J");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn trapezoid() {
        let t = Instant::now();
        let s = [
            (t, 100.0),
            (t + Duration::from_millis(100), 200.0),
            (t + Duration::from_millis(200), 200.0),
        ];
        assert!((integrate(&s).unwrap() - 35.0).abs() < 1e-9);
        assert_eq!(integrate(&s[..1]), None);
    }
}
