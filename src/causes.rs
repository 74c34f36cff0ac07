//! An error shown with what caused it, on one line.
//!
//! Many errors here name what was being done (`FILE: cannot open`) and keep why in their
//! source (a link refused as untrusted, a missing file, a permission). Where an error becomes
//! text that is logged, sent to systemd or answered to `flowhost reload`, rather than
//! printed by the CLI (which prints every cause), the why must travel with it.

use std::fmt;

/// Displays an error followed by each of its causes, `: `-separated; a cause whose words
/// the text already holds (an error that quotes its source) is not said twice.
pub struct WithCauses<'a>(pub &'a dyn std::error::Error);

impl fmt::Display for WithCauses<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut text = self.0.to_string();
        let mut cause = self.0.source();
        while let Some(c) = cause {
            let said = c.to_string();
            if !text.contains(&said) {
                text.push_str(": ");
                text.push_str(&said);
            }
            cause = c.source();
        }
        f.write_str(&text)
    }
}

#[cfg(test)]
mod tests {
    /// A file error says why it could not be opened, not only that it could not.
    #[test]
    fn a_file_error_shows_what_the_system_said() {
        let e = crate::files::read_text(std::path::Path::new("/no/such/file"), 10).unwrap_err();
        let shown = super::WithCauses(&e).to_string();
        assert!(shown.starts_with("/no/such/file: cannot open: "), "{shown}");
        assert!(shown.contains("No such file"), "{shown}");
        // An error that quotes its source says it once.
        let quoting = crate::daemon::StartupError::RetainedSet(e);
        let shown = super::WithCauses(&quoting).to_string();
        assert_eq!(shown.matches("cannot open").count(), 1, "{shown}");
    }
}
