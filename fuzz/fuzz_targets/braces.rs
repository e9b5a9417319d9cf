//! The brace expander, two ways.
//!
//! - Structured: a pattern built from literals, numeric ranges (with padding and steps),
//!   letter ranges and alternatives. Property: the expansion is exactly the cartesian product
//!   of the parts, in order, computed here independently (so its length is the product of the
//!   range sizes), or `TooMany` exactly when that product is over the limit.
//! - Raw: any string. Properties: no panic, never more than `MAX_EXPANSION` names, `count`
//!   agrees with `expand`, and a string without braces or backslashes is its own only
//!   expansion.
#![cfg_attr(not(test), no_main)]

#[cfg(test)] // tests/fuzz_seeds.rs checks what each seed reached
use crate::reached;
use arbitrary::{Arbitrary, Unstructured};
#[cfg(not(test))] // tests/fuzz_seeds.rs has its own
use libfuzzer_sys::fuzz_target;
use shardd::config::braces::{self, BraceError, MAX_EXPANSION};

/// What a seed reached: recorded by tests/fuzz_seeds.rs, nothing in the fuzz build.
#[cfg(not(test))]
fn reached(_: impl AsRef<str>) {}

#[derive(Debug, Arbitrary)]
enum Part {
    /// Text without `{}\,` (commas are literal outside braces, but keep the model simple).
    Literal(String),
    Numeric {
        from: i64,
        to: i64,
        step: Option<i64>,
        /// Write `from` zero-padded to this many digits.
        pad: u8,
    },
    Letters {
        from: u8,
        to: u8,
        step: Option<i8>,
    },
    Alternatives(Vec<String>),
}

fn clean(s: &str) -> String {
    s.chars().filter(|c| !"{},\\.".contains(*c)).collect()
}

/// The pattern text of a part, how many names it stands for, and those names (`None`: too
/// many to list).
fn part(p: &Part) -> Option<(String, u128, Option<Vec<String>>)> {
    let (text, names) = part_names(p)?;
    let count = match (&names, p) {
        (Some(n), _) => n.len() as u128,
        (None, Part::Numeric { from, to, step, .. }) => {
            let step = step.map_or(1u64, |s| s.unsigned_abs().max(1));
            (*from as i128 - *to as i128).unsigned_abs() / step as u128 + 1
        }
        (None, _) => unreachable!("only numeric ranges are too long to list"),
    };
    Some((text, count, names))
}

fn part_names(p: &Part) -> Option<(String, Option<Vec<String>>)> {
    Some(match p {
        Part::Literal(s) => {
            let s = clean(s);
            (s.clone(), Some(vec![s]))
        }
        Part::Numeric {
            from,
            to,
            step,
            pad,
        } => {
            let pad = (*pad % 12) as usize;
            let from_text = if pad > 1 && *from >= 0 {
                format!("{from:0pad$}")
            } else {
                from.to_string()
            };
            let text = match step {
                Some(s) => format!("{{{from_text}..{to}..{s}}}"),
                None => format!("{{{from_text}..{to}}}"),
            };
            // bash/braceexpand semantics: |step| (0 counts as 1), direction from the ends.
            let step = step.map_or(1u64, |s| s.unsigned_abs().max(1));
            let count = (*from as i128 - *to as i128).unsigned_abs() / step as u128 + 1;
            if count > 20_000 {
                return Some((text, None)); // too many to list at fuzzing speed
            }
            // Zero padding on either end pads every name to the longer end's width.
            let padded = from_text.len() > 1 && from_text.starts_with('0');
            let width = if padded {
                from_text.len().max(to.to_string().len())
            } else {
                0
            };
            let dir: i128 = if to >= from { 1 } else { -1 };
            let names = (0..count as i128)
                .map(|k| {
                    let v = *from as i128 + k * step as i128 * dir;
                    format!("{v:0width$}")
                })
                .collect();
            (text, Some(names))
        }
        Part::Letters { from, to, step } => {
            // braceexpand's letter ranges run over this alphabet, not ASCII.
            let letters = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
            let (a, b) = (*from as usize % letters.len(), *to as usize % letters.len());
            let text = match step {
                Some(s) => format!("{{{}..{}..{s}}}", letters[a] as char, letters[b] as char),
                None => format!("{{{}..{}}}", letters[a] as char, letters[b] as char),
            };
            let step = step.map_or(1, |s| s.unsigned_abs().max(1)) as usize;
            let names = if a <= b {
                (a..=b).step_by(step).collect::<Vec<_>>()
            } else {
                (b..=a).rev().step_by(step).collect()
            };
            let names = names
                .into_iter()
                .map(|i| (letters[i] as char).to_string())
                .collect();
            (text, Some(names))
        }
        Part::Alternatives(alts) => {
            let alts: Vec<String> = alts.iter().map(|a| clean(a)).collect();
            if alts.len() < 2 {
                return None; // `{x}` is a literal; `{}` too: not modelled here
            }
            (format!("{{{}}}", alts.join(",")), Some(alts))
        }
    })
}

fn structured(u: &mut Unstructured) -> arbitrary::Result<()> {
    let parts: Vec<Part> = u.arbitrary()?;
    let mut pattern = String::new();
    let mut names: Option<Vec<String>> = Some(vec![String::new()]);
    let mut count: u128 = 1;
    for p in parts.iter().take(6) {
        let Some((text, n, these)) = part(p) else {
            return Ok(());
        };
        pattern.push_str(&text);
        count = count.saturating_mul(n);
        names = match (names, these) {
            (Some(prev), Some(these)) if count <= 20_000 => Some(
                prev.iter()
                    .flat_map(|h| these.iter().map(move |t| format!("{h}{t}")))
                    .collect(),
            ),
            _ => None,
        };
    }
    if std::env::var_os("FUZZ_PRINT").is_some() {
        eprintln!("pattern: {pattern:?}, names: {count}"); // triage: replaying an artifact
    }
    if count > MAX_EXPANSION as u128 {
        assert_eq!(
            braces::expand(&pattern),
            Err(BraceError::TooMany),
            "{pattern:?}"
        );
        return Ok(());
    }
    if count > 20_000 {
        return Ok(()); // right, but too slow to check at fuzzing speed
    }
    let got = braces::expand(&pattern).unwrap_or_else(|e| panic!("{pattern:?}: {e}"));
    assert_eq!(got.len() as u128, count, "{pattern:?}");
    if let Some(names) = names {
        assert_eq!(got, names, "{pattern:?}");
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return reached("empty");
    };
    if mode % 2 == 0 {
        let built = structured(&mut Unstructured::new(rest));
        return reached(if built.is_ok() {
            "structured"
        } else {
            "unbuildable"
        });
    }
    let Ok(pattern) = std::str::from_utf8(rest) else {
        return reached("not UTF-8");
    };
    // Counting never expands: it must agree with the expansion, and it lets us skip
    // expansions that are right but too slow to check at fuzzing speed.
    let counted = braces::count(pattern);
    if counted.as_ref().is_ok_and(|n| *n > 20_000) {
        return reached("counted, too many to expand");
    }
    let expanded = braces::expand(pattern);
    match (&counted, &expanded) {
        (Ok(n), Ok(names)) => assert_eq!(*n, names.len() as u64),
        (Err(a), Err(b)) => assert_eq!(a, b),
        _ => panic!("count {counted:?} but expand {expanded:?}"),
    }
    match expanded {
        Ok(names) => {
            assert!(names.len() <= MAX_EXPANSION);
            if !pattern.contains(['{', '}', '\\']) {
                assert_eq!(names, [pattern]);
            }
            reached("expanded");
        }
        Err(BraceError::Unbalanced) => {
            assert!(pattern.contains(['{', '}']));
            reached("unbalanced");
        }
        Err(BraceError::TooMany | BraceError::Number(_)) => reached("too many"),
    }
});
