//! Brace expansion of shard patterns, a port of the `braceexpand` package (0.1.7) that
//! webdataset uses, quirks included, so a pattern names the same shards in shardd as in
//! webdataset: `train-{000000..000639}.tar` (numeric ranges, zero padding when an end starts
//! with 0, optional `..step`), `{a..e}` (letter ranges over `A..Za..z`), `{train,val}`
//! (alternatives), nesting, `\{` for a literal; a group that is none of these (`{x}`) keeps
//! its braces and expands inside them.
//!
//! The size of an expansion is computed before anything is generated, so a typo like
//! `{0..999999999}` fails at once instead of allocating gigabytes.
//! Differences from braceexpand: digits are ASCII only (Python's `\d` takes any Unicode
//! digit), and a range bound beyond ±10^38 is an error instead of a Python big integer.

/// Largest expansion accepted from one pattern (names).
pub const MAX_EXPANSION: usize = 10_000_000;
/// Largest expansion accepted from one pattern (bytes of names, counted generously: every
/// name as long as the longest).
pub const MAX_EXPANSION_BYTES: u64 = 1 << 30;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BraceError {
    #[error("unbalanced braces")]
    Unbalanced,
    #[error("expands to more than {MAX_EXPANSION} names or {MAX_EXPANSION_BYTES} bytes")]
    TooMany,
    #[error("range bound {0:?} is too large")]
    Number(String),
}

/// Expands `pattern` into the list of names it denotes, in order.
pub fn expand(pattern: &str) -> Result<Vec<String>, BraceError> {
    let node = parse_pattern(pattern.as_bytes())?;
    check_size(&node)?;
    let mut out = Vec::with_capacity(node.count() as usize);
    node.generate(&mut Vec::new(), &mut |name| out.push(unescape(name)));
    Ok(out)
}

/// How many names `pattern` expands to, without expanding it.
pub fn count(pattern: &str) -> Result<u64, BraceError> {
    let node = parse_pattern(pattern.as_bytes())?;
    check_size(&node)?;
    Ok(node.count() as u64)
}

fn check_size(node: &Node) -> Result<(), BraceError> {
    let (count, longest) = (node.count(), node.longest());
    if count > MAX_EXPANSION as u128 || count.saturating_mul(longest) > MAX_EXPANSION_BYTES as u128
    {
        return Err(BraceError::TooMany);
    }
    Ok(())
}

/// A parsed pattern: what braceexpand builds from `itertools.product` and `chain`.
#[derive(Debug)]
enum Node {
    Literal(Vec<u8>),
    /// Every combination of the parts, the last varying fastest (`product`).
    Product(Vec<Node>),
    /// Each alternative's names in turn (`chain`).
    Chain(Vec<Node>),
    Ints {
        start: i128,
        step: u128,
        /// Names after the first: `count - 1`.
        steps: u128,
        down: bool,
        width: usize,
    },
    Letters {
        start: usize,
        step: usize,
        steps: usize,
        down: bool,
    },
}

const ALPHABET: &[u8; 52] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

impl Node {
    /// Names, saturating (never 0: every node stands for at least one name).
    fn count(&self) -> u128 {
        match self {
            Node::Literal(_) => 1,
            Node::Product(parts) => parts.iter().fold(1u128, |n, p| n.saturating_mul(p.count())),
            Node::Chain(alts) => alts.iter().fold(0u128, |n, a| n.saturating_add(a.count())),
            Node::Ints { steps, .. } => steps.saturating_add(1),
            Node::Letters { steps, .. } => *steps as u128 + 1,
        }
    }

    /// An upper bound on the length of one name.
    fn longest(&self) -> u128 {
        match self {
            Node::Literal(l) => l.len() as u128,
            Node::Product(parts) => parts
                .iter()
                .fold(0u128, |n, p| n.saturating_add(p.longest())),
            Node::Chain(alts) => alts.iter().map(Node::longest).max().unwrap_or(0),
            // A sign and 39 digits hold any i128.
            Node::Ints { width, .. } => (*width).max(40) as u128,
            Node::Letters { .. } => 1,
        }
    }

    /// Calls `emit` with each name (before unescaping) appended to `name`, in order; `emit`
    /// leaves `name` as it found it.
    fn generate(&self, name: &mut Vec<u8>, emit: &mut dyn FnMut(&mut Vec<u8>)) {
        match self {
            Node::Literal(l) => {
                name.extend_from_slice(l);
                emit(name);
                name.truncate(name.len() - l.len());
            }
            Node::Product(parts) => product(parts, name, emit),
            Node::Chain(alts) => alts.iter().for_each(|a| a.generate(name, emit)),
            Node::Ints {
                start,
                step,
                steps,
                down,
                width,
            } => {
                for k in 0..=*steps {
                    // k * step is at most |end - start|, so v lies between the ends and the
                    // wrapping arithmetic is exact.
                    let offset = k * step;
                    let v = match down {
                        true => start.wrapping_sub_unsigned(offset),
                        false => start.wrapping_add_unsigned(offset),
                    };
                    let len = name.len();
                    name.extend_from_slice(format!("{v:0width$}").as_bytes());
                    emit(name);
                    name.truncate(len);
                }
            }
            Node::Letters {
                start,
                step,
                steps,
                down,
            } => {
                for k in 0..=*steps {
                    let i = if *down {
                        start - k * step
                    } else {
                        start + k * step
                    };
                    name.push(ALPHABET[i]);
                    emit(name);
                    name.pop();
                }
            }
        }
    }
}

fn product(parts: &[Node], name: &mut Vec<u8>, emit: &mut dyn FnMut(&mut Vec<u8>)) {
    match parts.split_first() {
        None => emit(name),
        Some((first, rest)) => first.generate(name, &mut |name| product(rest, name, emit)),
    }
}

/// braceexpand's `parse_pattern`: literals and `{...}` groups, in a product.
fn parse_pattern(pattern: &[u8]) -> Result<Node, BraceError> {
    let (mut start, mut pos, mut depth) = (0usize, 0usize, 0i64);
    let mut items = Vec::new();
    while pos < pattern.len() {
        match pattern[pos] {
            b'\\' => {
                pos += 2;
                continue;
            }
            b'{' => {
                if depth == 0 && pos > start {
                    items.push(Node::Literal(pattern[start..pos].to_vec()));
                    start = pos;
                }
                depth += 1;
            }
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    // `start` is at the `{` that opened this group (it is set whenever the
                    // depth goes from 0 to 1).
                    let expr = &pattern[start + 1..pos];
                    match parse_expression(expr)? {
                        Some(node) => items.push(node),
                        None => {
                            items.push(Node::Literal(b"{".to_vec()));
                            items.push(parse_pattern(expr)?);
                            items.push(Node::Literal(b"}".to_vec()));
                        }
                    }
                    start = pos + 1;
                }
            }
            _ => {}
        }
        pos += 1;
    }
    if depth != 0 {
        return Err(BraceError::Unbalanced);
    }
    if start < pos {
        items.push(Node::Literal(pattern[start..].to_vec()));
    }
    Ok(Node::Product(items))
}

/// braceexpand's `parse_expression`: a range, a sequence, or `None` (not an expression).
fn parse_expression(expr: &[u8]) -> Result<Option<Node>, BraceError> {
    if let Some(node) = int_range(expr)? {
        return Ok(Some(node));
    }
    if let Some(node) = char_range(expr) {
        return Ok(Some(node));
    }
    parse_sequence(expr)
}

/// braceexpand's `parse_sequence`: alternatives split at top-level commas.
fn parse_sequence(seq: &[u8]) -> Result<Option<Node>, BraceError> {
    let (mut start, mut pos, mut depth) = (0usize, 0usize, 0i64);
    let mut items = Vec::new();
    while pos < seq.len() {
        match seq[pos] {
            b'\\' => {
                pos += 2;
                continue;
            }
            b'{' => depth += 1,
            b'}' => depth -= 1,
            b',' if depth == 0 => {
                items.push(parse_pattern(&seq[start..pos])?);
                start = pos + 1;
            }
            _ => {}
        }
        pos += 1;
    }
    if depth != 0 || items.is_empty() {
        return Ok(None);
    }
    items.push(parse_pattern(&seq[start..])?);
    Ok(Some(Node::Chain(items)))
}

/// `A..B` or `A..B..C`: the ends and the step, unchecked.
struct RangeParts<'a> {
    start: &'a [u8],
    end: &'a [u8],
    step: Option<&'a [u8]>,
}

/// Splits `A..B` or `A..B..C` (the parts are checked by the caller). Python's `$` also
/// matches before a final newline, so `{1..3\n}` is a range too.
fn range_parts(expr: &[u8]) -> Option<RangeParts<'_>> {
    let expr = expr.strip_suffix(b"\n").unwrap_or(expr);
    let mut parts = expr.split(|b| *b == b'.');
    // `..` splits into an empty piece between the dots.
    let (a, e1, b) = (parts.next()?, parts.next()?, parts.next()?);
    if !e1.is_empty() {
        return None;
    }
    let step = match (parts.next(), parts.next(), parts.next()) {
        (None, _, _) => None,
        (Some([]), Some(c), None) => Some(c),
        _ => return None,
    };
    Some(RangeParts {
        start: a,
        end: b,
        step,
    })
}

fn digits(s: &[u8]) -> bool {
    !s.is_empty() && s.iter().all(u8::is_ascii_digit)
}

fn signed_digits(s: &[u8]) -> bool {
    digits(s.strip_prefix(b"-").unwrap_or(s))
}

/// The step: `..-?(\d+)`, its sign ignored, 0 meaning 1. Saturates (a step that large
/// leaves one name either way).
fn step(s: Option<&[u8]>) -> Option<u128> {
    match s {
        None => Some(1),
        Some(s) => {
            let s = s.strip_prefix(b"-").unwrap_or(s);
            digits(s).then(|| {
                s.iter()
                    .fold(0u128, |n, d| {
                        n.saturating_mul(10).saturating_add((d - b'0') as u128)
                    })
                    .max(1)
            })
        }
    }
}

/// `^(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?$` and `make_int_range`.
fn int_range(expr: &[u8]) -> Result<Option<Node>, BraceError> {
    let Some(RangeParts {
        start: a,
        end: b,
        step: step_text,
    }) = range_parts(expr)
    else {
        return Ok(None);
    };
    if !signed_digits(a) || !signed_digits(b) {
        return Ok(None);
    }
    let Some(step) = step(step_text) else {
        return Ok(None);
    };
    let number = |s: &[u8]| {
        let text = std::str::from_utf8(s).expect("ASCII digits");
        text.parse::<i128>()
            .map_err(|_| BraceError::Number(text.to_string()))
    };
    let (start, end) = (number(a)?, number(b)?);
    let padded =
        |s: &[u8]| s != b"0" && s != b"-0" && (s.starts_with(b"0") || s.starts_with(b"-0"));
    let width = if padded(a) || padded(b) {
        a.len().max(b.len())
    } else {
        0
    };
    Ok(Some(Node::Ints {
        start,
        step,
        steps: start.abs_diff(end) / step,
        down: start >= end,
        width,
    }))
}

/// `^([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?$` and `make_char_range`: over `A..Za..z`, so
/// `{Z..a}` is `Z`, `a` (not the punctuation between them in ASCII).
fn char_range(expr: &[u8]) -> Option<Node> {
    let RangeParts {
        start: a,
        end: b,
        step: step_text,
    } = range_parts(expr)?;
    let letter = |s: &[u8]| match s {
        [c] => ALPHABET.iter().position(|l| l == c),
        _ => None,
    };
    let (start, end) = (letter(a)?, letter(b)?);
    let step = step(step_text)?.min(ALPHABET.len() as u128) as usize;
    Some(Node::Letters {
        start,
        step,
        steps: start.abs_diff(end) / step,
        down: start >= end,
    })
}

/// braceexpand's `escape_re.sub(r'\1', s)` with `\\(.)`: a backslash is dropped before any
/// character but a newline (`.`), and kept at the very end.
fn unescape(name: &[u8]) -> String {
    let text = String::from_utf8_lossy(name);
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, chars.peek()) {
            ('\\', Some(&next)) if next != '\n' => {
                out.push(next);
                chars.next();
            }
            (c, _) => out.push(c),
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

    /// Issue 8 (fuzzing, `braces` target, and reading braceexpand): every expected value
    /// below was computed with braceexpand 0.1.7. Before the port, `{X..c}` had the ASCII
    /// punctuation between `Z` and `a` (and lost the backslash), `{a{1..2}}` was not
    /// expanded inside, `{+1..3}` was a range, `a}{` was refused, a trailing backslash was
    /// dropped, and steps or ends near i64::MAX overflowed (a panic).
    #[test]
    fn matches_braceexpand() {
        let cases: &[(&str, &[&str])] = &[
            ("{a{1..2}}", &["{a1}", "{a2}"]),
            ("{X..c}", &["X", "Y", "Z", "a", "b", "c"]),
            ("{c..X}", &["c", "b", "a", "Z", "Y", "X"]),
            ("{Z..a}", &["Z", "a"]),
            ("{a..Z}", &["a", "Z"]),
            ("{A..z..13}", &["A", "N", "a", "n"]),
            ("{+1..3}", &["{+1..3}"]),
            ("{1..3..-2}", &["1", "3"]),
            (
                "{0..10..0}",
                &["0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10"],
            ),
            (
                "{-05..3}",
                &[
                    "-05", "-04", "-03", "-02", "-01", "000", "001", "002", "003",
                ],
            ),
            ("{5..-0}", &["5", "4", "3", "2", "1", "0"]),
            ("{00..-0}", &["00"]),
            ("{1..3}{}", &["1{}", "2{}", "3{}"]),
            ("{a,b}{x}", &["a{x}", "b{x}"]),
            ("\\\\{a,b}", &["\\a", "\\b"]),
            ("{a\\,b,c}", &["a,b", "c"]),
            ("a}{", &["a}{"]),
            ("{}", &["{}"]),
            ("{,}", &["", ""]),
            ("{a..c}\\\\", &["a\\", "b\\", "c\\"]),
            ("{1..3\n}", &["1", "2", "3"]),
            ("a\\\nb", &["a\\\nb"]),
            (
                "{-9223372036854775808..9223372036854775807..9223372036854775807}",
                &["-9223372036854775808", "-1", "9223372036854775806"],
            ),
            ("{0..-9..-9223372036854775808}", &["0"]),
            ("{0..-9..99999999999999999999999999999999999999999}", &["0"]),
            (
                "{170141183460469231731687303715884105727..170141183460469231731687303715884105726}",
                &[
                    "170141183460469231731687303715884105727",
                    "170141183460469231731687303715884105726",
                ],
            ),
            ("x{a,b{1..2},}y", &["xay", "xb1y", "xb2y", "xy"]),
            (
                "{1..2}{a,b}{9..8}",
                &["1a9", "1a8", "1b9", "1b8", "2a9", "2a8", "2b9", "2b8"],
            ),
            ("{a..c}\\", &["a\\", "b\\", "c\\"]),
        ];
        for (pattern, want) in cases {
            assert_eq!(expand(pattern).unwrap(), *want, "{pattern:?}");
            assert_eq!(count(pattern).unwrap(), want.len() as u64, "{pattern:?}");
        }
    }

    /// Issue 8 (fuzzing): refusing `{0..9}{0..999999}{0..9}` took seconds and a gigabyte,
    /// because the expansion was built before it was counted. Now it is counted first; and
    /// the bytes count too, not only the names.
    #[test]
    fn sizes_are_refused_before_expanding() {
        assert_eq!(expand("{0..9}{0..999999}{0..9}"), Err(BraceError::TooMany));
        assert_eq!(count("{0..9}{0..999999}{0..9}"), Err(BraceError::TooMany));
        assert_eq!(count("{0..9}{0..999999}"), Ok(10_000_000));
        let long = format!("{}{{0..9999999}}", "x".repeat(200));
        assert_eq!(count(&long), Err(BraceError::TooMany));
        let huge = format!("{{0..{}}}", "9".repeat(40));
        assert_eq!(expand(&huge), Err(BraceError::Number("9".repeat(40))));
    }

    #[test]
    fn errors() {
        assert_eq!(expand("a{0..2"), Err(BraceError::Unbalanced));
        assert_eq!(expand("a}"), Err(BraceError::Unbalanced));
        assert_eq!(expand("{0..9999}{0..9999}"), Err(BraceError::TooMany));
        assert_eq!(expand("{0..99999999}"), Err(BraceError::TooMany));
    }
}
