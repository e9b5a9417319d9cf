//! Brace expansion of shard patterns, as the `braceexpand` package that webdataset uses does
//! it: `train-{000000..000639}.tar` (numeric ranges keep zero padding, optional `..step`),
//! `{a..e}` (letter ranges), `{train,val}` (alternatives), nested braces, `\{` for a literal.

/// Largest expansion accepted from one pattern; a typo like `{0..999999999}` should fail fast
/// instead of allocating gigabytes.
pub const MAX_EXPANSION: usize = 10_000_000;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BraceError {
    #[error("unbalanced braces")]
    Unbalanced,
    #[error("expands to more than {MAX_EXPANSION} names")]
    TooMany,
}

/// Expands `pattern` into the list of names it denotes, in order.
pub fn expand(pattern: &str) -> Result<Vec<String>, BraceError> {
    let mut out = Vec::new();
    expand_into(pattern, &mut out)?;
    Ok(out.into_iter().map(|s| unescape(&s)).collect())
}

fn expand_into(pattern: &str, out: &mut Vec<String>) -> Result<(), BraceError> {
    let Some((open, close)) = first_group(pattern)? else {
        out.push(pattern.to_string());
        return Ok(());
    };
    let (prefix, body, suffix) = (
        &pattern[..open],
        &pattern[open + 1..close],
        &pattern[close + 1..],
    );
    let alternatives = match split_top_level(body) {
        parts if parts.len() > 1 => parts.into_iter().map(str::to_string).collect(),
        _ => match range(body)? {
            Some(items) => items,
            // Not an expansion (`{x}`): keep the braces literally, expand what follows.
            None => {
                let mut rest = Vec::new();
                expand_into(suffix, &mut rest)?;
                for r in rest {
                    out.push(format!("{prefix}{{{body}}}{r}"));
                }
                return Ok(());
            }
        },
    };
    let mut tails = Vec::new();
    expand_into(suffix, &mut tails)?;
    if alternatives.len().saturating_mul(tails.len()) > MAX_EXPANSION {
        return Err(BraceError::TooMany);
    }
    for alt in alternatives {
        let mut heads = Vec::new();
        expand_into(&format!("{prefix}{alt}"), &mut heads)?;
        if out.len() + heads.len() * tails.len() > MAX_EXPANSION {
            return Err(BraceError::TooMany);
        }
        for h in &heads {
            for t in &tails {
                out.push(format!("{h}{t}"));
            }
        }
    }
    Ok(())
}

/// Byte offsets of the first unescaped `{` and its matching `}`.
fn first_group(s: &str) -> Result<Option<(usize, usize)>, BraceError> {
    let bytes = s.as_bytes();
    let mut depth = 0usize;
    let mut open = None;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 1,
            b'{' => {
                if depth == 0 {
                    open = Some(i);
                }
                depth += 1;
            }
            b'}' => {
                if depth == 0 {
                    return Err(BraceError::Unbalanced);
                }
                depth -= 1;
                if depth == 0 {
                    return Ok(Some((open.unwrap(), i)));
                }
            }
            _ => {}
        }
        i += 1;
    }
    if depth > 0 {
        Err(BraceError::Unbalanced)
    } else {
        Ok(None)
    }
}

fn split_top_level(body: &str) -> Vec<&str> {
    let bytes = body.as_bytes();
    let (mut depth, mut start, mut parts) = (0usize, 0usize, Vec::new());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 1,
            b'{' => depth += 1,
            b'}' => depth = depth.saturating_sub(1),
            b',' if depth == 0 => {
                parts.push(&body[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    parts.push(&body[start..]);
    parts
}

/// `a..b` or `a..b..step` with integers (zero padding kept) or single letters.
fn range(body: &str) -> Result<Option<Vec<String>>, BraceError> {
    let parts: Vec<&str> = body.split("..").collect();
    let (from, to, step) = match parts.as_slice() {
        [a, b] => (*a, *b, 1i64),
        [a, b, s] => match s.parse::<i64>() {
            Ok(s) => (*a, *b, s.unsigned_abs().max(1) as i64),
            Err(_) => return Ok(None),
        },
        _ => return Ok(None),
    };
    if let (Ok(a), Ok(b)) = (from.parse::<i64>(), to.parse::<i64>()) {
        let padded = |s: &str| {
            s.trim_start_matches('-').len() > 1 && s.trim_start_matches('-').starts_with('0')
        };
        let width = if padded(from) || padded(to) {
            from.len().max(to.len())
        } else {
            0
        };
        let count = (a.abs_diff(b) / step as u64) as usize + 1;
        if count > MAX_EXPANSION {
            return Err(BraceError::TooMany);
        }
        let dir = if b >= a { step } else { -step };
        return Ok(Some(
            (0..count as i64)
                .map(|k| format!("{:0width$}", a + k * dir, width = width))
                .collect(),
        ));
    }
    let (mut fa, mut ta) = (from.chars(), to.chars());
    match (fa.next(), fa.next(), ta.next(), ta.next()) {
        (Some(a), None, Some(b), None) if a.is_ascii_alphabetic() && b.is_ascii_alphabetic() => {
            let (a, b) = (a as i64, b as i64);
            let dir = if b >= a { step } else { -step };
            let count = a.abs_diff(b) / step as u64 + 1;
            Ok(Some(
                (0..count as i64)
                    .map(|k| char::from((a + k * dir) as u8).to_string())
                    .collect(),
            ))
        }
        _ => Ok(None),
    }
}

fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.extend(chars.next()),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(p: &str) -> Vec<String> {
        expand(p).unwrap()
    }

    #[test]
    fn numeric_ranges_keep_padding() {
        assert_eq!(
            e("t-{000..002}.tar"),
            ["t-000.tar", "t-001.tar", "t-002.tar"]
        );
        assert_eq!(e("t-{8..11}"), ["t-8", "t-9", "t-10", "t-11"]);
        assert_eq!(e("{09..11}"), ["09", "10", "11"]);
        assert_eq!(e("{3..1}"), ["3", "2", "1"]);
        assert_eq!(e("{0..10..5}"), ["0", "5", "10"]);
        assert_eq!(e("gs://b/train-{000000..000639}.tar").len(), 640);
    }

    #[test]
    fn alternatives_letters_and_nesting() {
        assert_eq!(
            e("{train,val}-{0..1}"),
            ["train-0", "train-1", "val-0", "val-1"]
        );
        assert_eq!(e("{a..c}"), ["a", "b", "c"]);
        assert_eq!(e("x{a,b{1..2}}y"), ["xay", "xb1y", "xb2y"]);
        assert_eq!(e("plain.tar"), ["plain.tar"]);
    }

    #[test]
    fn literal_and_escaped_braces() {
        assert_eq!(e("a{b}c"), ["a{b}c"]);
        assert_eq!(e(r"a\{0..2\}"), ["a{0..2}"]);
        assert_eq!(e("{x}-{0..1}"), ["{x}-0", "{x}-1"]);
    }

    #[test]
    fn errors() {
        assert_eq!(expand("a{0..2"), Err(BraceError::Unbalanced));
        assert_eq!(expand("a}"), Err(BraceError::Unbalanced));
        assert_eq!(expand("{0..9999}{0..9999}"), Err(BraceError::TooMany));
        assert_eq!(expand("{0..99999999}"), Err(BraceError::TooMany));
    }
}
