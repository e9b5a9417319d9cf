//! An error and its causes on one line, each cause once: a cause an error's message already
//! holds (a thiserror `{source}`) is not repeated. What the commands print, and what the
//! stores report of a transport error.

/// `e`'s message, then each cause its text does not already hold, joined by ": ".
pub fn one_line(e: &(dyn std::error::Error + 'static)) -> String {
    let mut line = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !line.contains(&text) {
            line = format!("{line}: {text}");
        }
        source = cause.source();
    }
    line
}
