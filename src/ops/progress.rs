//! Progress of a long command (`warm`, `index`, `check`): a bar on a terminal, a plain line
//! every few seconds otherwise (a log file or CI).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// A progress bar on a terminal; a plain line every few seconds otherwise.
pub struct Progress {
    name: String,
    bar: Option<ProgressBar>,
    total: u64,
    done: u64,
    bytes: u64,
    /// What the byte count is: "fetched", or "found" for `check`.
    verb: &'static str,
    started: Instant,
    last_line: Instant,
}

impl Progress {
    pub fn new(name: &str, total: u64) -> Progress {
        Progress::counting(name, total, "fetched")
    }

    /// Progress over `total` shards whose bytes are `verb` ("found": sizes, not downloads).
    pub fn counting(name: &str, total: u64, verb: &'static str) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(total);
            bar.set_style(
                ProgressStyle::with_template(
                    "{prefix} [{bar:30}] {pos}/{len} shards, {msg}, ETA {eta}",
                )
                .expect("a valid template")
                .progress_chars("=> "),
            );
            bar.set_prefix(name.to_string());
            bar
        });
        Progress {
            name: name.into(),
            bar,
            total,
            done: 0,
            bytes: 0,
            verb,
            started: Instant::now(),
            last_line: Instant::now(),
        }
    }

    pub fn add(&mut self, bytes: u64) {
        self.done += 1;
        self.bytes += bytes;
        let summary = self.summary();
        match &self.bar {
            Some(bar) => {
                bar.set_message(summary);
                bar.inc(1);
            }
            None if self.last_line.elapsed() >= Duration::from_secs(2) => {
                self.last_line = Instant::now();
                eprintln!(
                    "{}: {}/{} shards, {summary}",
                    self.name, self.done, self.total
                );
            }
            None => {}
        }
    }

    fn summary(&self) -> String {
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        format!(
            "{:.1} MB {}, {:.1} MB/s",
            self.bytes as f64 / 1e6,
            self.verb,
            self.bytes as f64 / 1e6 / secs
        )
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
        eprintln!(
            "{}: {}/{} shards done, {} in {:.1}s",
            self.name,
            self.done,
            self.total,
            self.summary(),
            self.started.elapsed().as_secs_f64()
        );
    }
}
