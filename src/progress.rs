//! A terminal progress bar for packing (feature `progress`): what `pack-dataset` and the Python
//! package's `imagefeed.pack` draw on stderr.

use indicatif::{ProgressBar, ProgressStyle};

use crate::pack::{PackObserver, Rejection};

/// A [`PackObserver`] drawing `bar  done/total files, bytes, rate, ETA` on stderr, with a line
/// for each rejected file and for a resumed run. Hidden ones draw nothing.
pub struct PackProgressBar {
    bar: ProgressBar,
}

impl PackProgressBar {
    /// A bar on stderr, or a hidden one when `quiet`.
    pub fn new(quiet: bool) -> PackProgressBar {
        let bar = if quiet {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(0)
        };
        bar.set_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} files, {msg}, {per_sec}, ETA {eta}")
                .expect("valid template"),
        );
        PackProgressBar { bar }
    }

    /// Removes the bar from the terminal.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl PackObserver for PackProgressBar {
    fn started(&self, total: usize, already_done: usize) {
        self.bar.set_length(total as u64);
        self.bar.set_position(already_done as u64);
        self.bar.reset_eta();
        if already_done > 0 {
            self.bar.println(format!(
                "resuming: {already_done} of {total} files already packed"
            ));
        }
    }

    fn advanced(&self, done: usize, payload_bytes: u64) {
        self.bar.set_position(done as u64);
        self.bar.set_message(human_bytes(payload_bytes));
    }

    fn rejected(&self, rejection: &Rejection) {
        self.bar
            .println(format!("rejected {}: {}", rejection.key, rejection.reason));
    }
}

/// `1234567` → `1.2 MB` (powers of 1000; bytes below 1000 as `N B`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KB", "MB", "GB", "TB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit < UNITS.len() - 1 {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::human_bytes;

    #[test]
    fn bytes_read_in_powers_of_a_thousand() {
        assert_eq!(human_bytes(999), "999 B");
        assert_eq!(human_bytes(1_000), "1.0 KB");
        assert_eq!(human_bytes(1_234_567), "1.2 MB");
        assert_eq!(human_bytes(5_000_000_000_000_000), "5000.0 TB");
    }
}
