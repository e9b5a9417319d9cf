//! The daemon's form of a manifest, [`Loaded`]: one column per field, parsed from the JSON as
//! a stream. At a million shards a `Vec<Entry>` (three heap strings each) took ~240 MB on top
//! of the manifest's text, and the start-up peak was that plus the configured shards; the
//! columns take ~70 MB, and URLs that are the configured shards in order are compared, not
//! kept.
//!
//! Only inputs the derived `Manifest` accepts are taken here: anything this parser does not
//! take (an error, or a form it does not read, like a struct as a JSON array) goes through
//! [`Manifest::parse`] instead, so the accepted files and the error messages stay exactly
//! those of the derived parser.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::{Manifest, ManifestError, check_totals, positions_of};
use crate::config::url::ShardUrl;
use crate::store::Version;

/// Strings back to back in one buffer (one allocation, not one per string); the top bit of
/// an end marks a `None`.
#[derive(Debug, Default)]
struct Strings {
    text: String,
    ends: Vec<u64>,
}

const NONE: u64 = 1 << 63;

impl Strings {
    fn with_capacity(n: usize) -> Strings {
        Strings {
            text: String::new(),
            ends: Vec::with_capacity(n),
        }
    }

    /// Ends the string appended to `text` since the last end (or marks a `None`).
    fn end(&mut self, some: bool) {
        let end = self.text.len() as u64;
        self.ends.push(if some { end } else { end | NONE });
    }

    fn push(&mut self, s: Option<&str>) {
        if let Some(s) = s {
            self.text.push_str(s);
        }
        self.end(s.is_some());
    }

    fn get(&self, i: usize) -> Option<&str> {
        let start = i.checked_sub(1).map_or(0, |p| self.ends[p] & !NONE) as usize;
        let end = self.ends[i];
        (end & NONE == 0).then(|| &self.text[start..end as usize])
    }
}

/// A manifest as the daemon keeps it: sizes, versions, CRC-32Cs and sample counts by manifest
/// index, and the URLs only when they are not exactly the configured shards in order.
#[derive(Debug)]
pub struct Loaded {
    pub total_samples: u64,
    pub total_bytes: u64,
    samples: Vec<u64>,
    sizes: Vec<u64>,
    crc32c: Vec<u32>,
    e_tags: Strings,
    generations: Strings,
    /// `None`: the URLs are the configured shards, in order, all of them.
    urls: Option<Strings>,
}

impl Loaded {
    /// Parses a manifest for the configured `shards` (the URLs are checked against them by
    /// [`Loaded::positions`], not here): the same inputs and errors as [`Manifest::parse`].
    pub fn parse(text: &[u8], url: &str, shards: &[ShardUrl]) -> Result<Loaded, ManifestError> {
        let mut de = serde_json::Deserializer::from_slice(text);
        let streamed = Top { shards }
            .deserialize(&mut de)
            .and_then(|top| de.end().map(|()| top));
        let (format, loaded) = match streamed {
            Ok(top) => top,
            // The derived parser has the final word: its error, or a form not read above.
            Err(_) => {
                let m = Manifest::parse(text, url)?;
                let mut columns = Columns::new(shards);
                for e in &m.shards {
                    columns.urls.push(&e.url);
                    columns.sizes.push(e.version.size);
                    columns.e_tags.push(e.version.e_tag.as_deref());
                    columns.generations.push(e.version.generation.as_deref());
                    columns.crc32c.push(e.crc32c);
                    columns.samples.push(e.samples);
                }
                (m.format, columns.finish(m.total_samples, m.total_bytes))
            }
        };
        check_totals(
            url,
            format,
            (loaded.total_samples, loaded.total_bytes),
            loaded.samples.iter().copied(),
            loaded.sizes.iter().copied(),
        )?;
        Ok(loaded)
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    pub fn samples(&self, i: usize) -> u64 {
        self.samples[i]
    }

    pub fn size(&self, i: usize) -> u64 {
        self.sizes[i]
    }

    pub fn crc32c(&self, i: usize) -> u32 {
        self.crc32c[i]
    }

    /// The version the manifest records for shard `i` (owned: built from the columns).
    pub fn version(&self, i: usize) -> Version {
        Version {
            size: self.sizes[i],
            e_tag: self.e_tags.get(i).map(str::to_owned),
            generation: self.generations.get(i).map(str::to_owned),
        }
    }

    /// [`Manifest::positions`]: where each of `shards` (the ones given to
    /// [`Loaded::parse`]) is in the manifest, after checking it names exactly these shards.
    pub fn positions(&self, url: &str, shards: &[ShardUrl]) -> Result<Vec<usize>, ManifestError> {
        match &self.urls {
            None => positions_of(self.len(), |i| shards[i].as_str(), url, shards),
            Some(urls) => positions_of(
                self.len(),
                |i| urls.get(i).expect("a URL is never None"),
                url,
                shards,
            ),
        }
    }

    /// [`Manifest::unchanged_at`].
    pub fn unchanged_at(
        &self,
        url: &str,
        shards: &[ShardUrl],
        at: &[usize],
        current: &[Version],
    ) -> Result<(), ManifestError> {
        super::unchanged_at(url, shards, at, current, |i| self.version(i))
    }
}

/// The columns as they fill, and the configured shards the URLs are compared with.
struct Columns<'a> {
    urls: Urls<'a>,
    samples: Vec<u64>,
    sizes: Vec<u64>,
    crc32c: Vec<u32>,
    e_tags: Strings,
    generations: Strings,
}

impl<'a> Columns<'a> {
    fn new(shards: &'a [ShardUrl]) -> Columns<'a> {
        let n = shards.len();
        Columns {
            urls: Urls {
                shards,
                n: 0,
                kept: None,
            },
            samples: Vec::with_capacity(n),
            sizes: Vec::with_capacity(n),
            crc32c: Vec::with_capacity(n),
            e_tags: Strings::with_capacity(n),
            generations: Strings::with_capacity(n),
        }
    }

    fn finish(mut self, total_samples: u64, total_bytes: u64) -> Loaded {
        let n = self.urls.n;
        if self.urls.kept.is_none() && n != self.urls.shards.len() {
            self.urls.keep();
        }
        Loaded {
            total_samples,
            total_bytes,
            samples: self.samples,
            sizes: self.sizes,
            crc32c: self.crc32c,
            e_tags: self.e_tags,
            generations: self.generations,
            urls: self.urls.kept,
        }
    }
}

/// The manifest's URLs: compared with the configured shards while they agree, kept from the
/// first that does not (with the agreeing ones before it, copied from the config).
struct Urls<'a> {
    shards: &'a [ShardUrl],
    /// URLs seen.
    n: usize,
    kept: Option<Strings>,
}

impl Urls<'_> {
    fn push(&mut self, url: &str) {
        if self.kept.is_none() && self.shards.get(self.n).is_some_and(|s| s.as_str() == url) {
            self.n += 1;
            return;
        }
        if self.kept.is_none() {
            self.keep();
        }
        self.kept.as_mut().expect("kept above").push(Some(url));
        self.n += 1;
    }

    /// Starts keeping URLs: the `n` seen so far are the first configured shards.
    fn keep(&mut self) {
        let mut kept = Strings::default();
        for s in &self.shards[..self.n] {
            kept.push(Some(s.as_str()));
        }
        self.kept = Some(kept);
    }
}

fn error<E: de::Error>() -> E {
    // Never shown: the derived parser gives the message (see `Loaded::parse`).
    E::custom("not a manifest")
}

/// The top-level object: `(format, manifest)`.
struct Top<'a> {
    shards: &'a [ShardUrl],
}

impl<'de> DeserializeSeed<'de> for Top<'_> {
    type Value = (u32, Loaded);

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Top<'_> {
    type Value = (u32, Loaded);

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a manifest")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let (mut format, mut columns, mut samples, mut bytes) = (None, None, None, None);
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Format if format.is_none() => format = Some(map.next_value::<u32>()?),
                Key::Shards if columns.is_none() => {
                    let mut c = Columns::new(self.shards);
                    map.next_value_seed(Shards(&mut c))?;
                    columns = Some(c);
                }
                Key::TotalSamples if samples.is_none() => samples = Some(map.next_value::<u64>()?),
                Key::TotalBytes if bytes.is_none() => bytes = Some(map.next_value::<u64>()?),
                Key::Format | Key::Shards | Key::TotalSamples | Key::TotalBytes => {
                    return Err(error());
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        match (format, columns, samples, bytes) {
            (Some(format), Some(c), Some(samples), Some(bytes)) => {
                Ok((format, c.finish(samples, bytes)))
            }
            _ => Err(error()),
        }
    }
}

/// A map key of either level, told without allocating (a million entries have six each).
#[derive(PartialEq)]
enum Key {
    Format,
    Shards,
    TotalSamples,
    TotalBytes,
    Url,
    Size,
    ETag,
    Generation,
    Crc32c,
    Samples,
    Other,
}

impl<'de> serde::Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        d.deserialize_identifier(KeyVisitor)
    }
}

struct KeyVisitor;

impl<'de> Visitor<'de> for KeyVisitor {
    type Value = Key;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a key")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Key, E> {
        Ok(match s {
            "format" => Key::Format,
            "shards" => Key::Shards,
            "total_samples" => Key::TotalSamples,
            "total_bytes" => Key::TotalBytes,
            "url" => Key::Url,
            "size" => Key::Size,
            "e_tag" => Key::ETag,
            "generation" => Key::Generation,
            "crc32c" => Key::Crc32c,
            "samples" => Key::Samples,
            _ => Key::Other,
        })
    }
}

/// The `shards` array, each entry into the columns.
struct Shards<'c, 'a>(&'c mut Columns<'a>);

impl<'de> DeserializeSeed<'de> for Shards<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Shards<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of shards")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Shard(&mut *self.0))?.is_some() {}
        Ok(())
    }
}

/// One entry: `{"url", "size", "e_tag", "generation", "crc32c", "samples"}`, any order,
/// unknown keys ignored (as the derived parser does).
struct Shard<'c, 'a>(&'c mut Columns<'a>);

impl<'de> DeserializeSeed<'de> for Shard<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Shard<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a shard")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let c = self.0;
        let (mut url, mut size, mut crc, mut samples) = (false, None, None, None);
        // Appended to their column's text as they come; ended below, once each.
        let (mut e_tag, mut generation) = (None, None);
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Url if !url => {
                    map.next_value_seed(UrlSeed(&mut c.urls))?;
                    url = true;
                }
                Key::Size if size.is_none() => size = Some(map.next_value::<u64>()?),
                Key::ETag if e_tag.is_none() => {
                    e_tag = Some(map.next_value_seed(OptStr(&mut c.e_tags.text))?)
                }
                Key::Generation if generation.is_none() => {
                    generation = Some(map.next_value_seed(OptStr(&mut c.generations.text))?)
                }
                Key::Crc32c if crc.is_none() => crc = Some(map.next_value::<u32>()?),
                Key::Samples if samples.is_none() => samples = Some(map.next_value::<u64>()?),
                Key::Url | Key::Size | Key::ETag | Key::Generation | Key::Crc32c | Key::Samples => {
                    return Err(error());
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let (true, Some(size), Some(crc), Some(samples)) = (url, size, crc, samples) else {
            return Err(error());
        };
        // A missing e_tag or generation is `None`, as for the derived `Option` fields.
        c.e_tags.end(e_tag.unwrap_or(false));
        c.generations.end(generation.unwrap_or(false));
        c.sizes.push(size);
        c.crc32c.push(crc);
        c.samples.push(samples);
        Ok(())
    }
}

/// A URL, straight to [`Urls::push`] (no allocation when it is the configured one).
struct UrlSeed<'u, 'a>(&'u mut Urls<'a>);

impl<'de> DeserializeSeed<'de> for UrlSeed<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for UrlSeed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<(), E> {
        self.0.push(s);
        Ok(())
    }
}

/// An optional string, appended to a column's text: whether it was there.
struct OptStr<'s>(&'s mut String);

impl<'de> DeserializeSeed<'de> for OptStr<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de> Visitor<'de> for OptStr<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string or null")
    }

    fn visit_none<E: de::Error>(self) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(Append(self.0))?;
        Ok(true)
    }
}

/// Appends a string to a buffer.
struct Append<'s>(&'s mut String);

impl<'de> Visitor<'de> for Append<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<(), E> {
        self.0.push_str(s);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn urls(names: &[&str]) -> Vec<ShardUrl> {
        names
            .iter()
            .map(|n| ShardUrl::parse(n, std::path::Path::new("/")).unwrap())
            .collect()
    }

    const TEXT: &str = r#"{"format":1,"shards":[
        {"url":"gs://b/a.tar","size":10,"e_tag":"x","generation":"7","crc32c":1,"samples":3},
        {"samples":5,"crc32c":2,"url":"gs://b/b.tar","size":20,"e_tag":null,"extra":[1,{"a":2}]},
        {"url":"gs://b/c\u002etar","size":30,"generation":"\"9\"","crc32c":3,"samples":7}
    ],"total_samples":15,"total_bytes":60,"note":"kept by nobody"}"#;

    /// Every field of every entry, and the positions, as the derived parser has them.
    fn assert_same(text: &str, shards: &[ShardUrl]) {
        let m = Manifest::parse(text.as_bytes(), "m.json").unwrap();
        let l = Loaded::parse(text.as_bytes(), "m.json", shards).unwrap();
        assert_eq!(
            (l.len(), l.is_empty()),
            (m.shards.len(), m.shards.is_empty())
        );
        assert_eq!(
            (l.total_samples, l.total_bytes),
            (m.total_samples, m.total_bytes)
        );
        for (i, e) in m.shards.iter().enumerate() {
            assert_eq!(l.version(i), e.version, "{i}");
            assert_eq!(
                (l.size(i), l.samples(i), l.crc32c(i)),
                (e.version.size, e.samples, e.crc32c),
                "{i}"
            );
        }
        let err = |e: ManifestError| e.to_string();
        assert_eq!(
            l.positions("m.json", shards).map_err(err),
            m.positions("m.json", shards).map_err(err)
        );
    }

    #[test]
    fn reads_what_the_derived_parser_reads() {
        let all = ["gs://b/a.tar", "gs://b/b.tar", "gs://b/c.tar"];
        assert_same(TEXT, &urls(&all));
        // Out of order, fewer, more, other and repeated shards: the same positions or errors.
        assert_same(
            TEXT,
            &urls(&["gs://b/c.tar", "gs://b/a.tar", "gs://b/b.tar"]),
        );
        assert_same(TEXT, &urls(&["gs://b/a.tar", "gs://b/b.tar"]));
        assert_same(
            TEXT,
            &urls(&[
                "gs://b/a.tar",
                "gs://b/b.tar",
                "gs://b/c.tar",
                "gs://b/d.tar",
            ]),
        );
        assert_same(
            TEXT,
            &urls(&["gs://b/a.tar", "gs://b/x.tar", "gs://b/c.tar"]),
        );
        assert_same(
            TEXT,
            &urls(&["gs://b/a.tar", "gs://b/a.tar", "gs://b/c.tar"]),
        );
        assert_same(TEXT, &urls(&[]));
        let twice = TEXT.replace("gs://b/b.tar", "gs://b/a.tar");
        assert_same(
            &twice,
            &urls(&["gs://b/a.tar", "gs://b/a.tar", "gs://b/c.tar"]),
        );
        // A struct as a JSON array is a form serde accepts: read by the derived parser.
        let array = r#"[1,[{"url":"gs://b/a.tar","size":10,"crc32c":1,"samples":3}],3,10]"#;
        assert_same(array, &urls(&["gs://b/a.tar"]));
        assert_same(
            r#"{"format":1,"shards":[],"total_samples":0,"total_bytes":0}"#,
            &[],
        );
    }

    #[test]
    fn malformed_manifests_fail_as_with_the_derived_parser() {
        let shards = urls(&["gs://b/a.tar"]);
        let one = r#"{"url":"gs://b/a.tar","size":10,"crc32c":1,"samples":3}"#;
        let top = |shards: &str, rest: &str| {
            format!(
                r#"{{"format":1,"shards":[{shards}],"total_samples":3,"total_bytes":10{rest}}}"#
            )
        };
        let cases = [
            String::new(),
            "{".into(),
            "null".into(),
            top(one, ",\"format\":1"),
            top(one, "} trailing"),
            top(one, "").replace("\"format\":1,", ""),
            top(one, "").replace(",\"total_bytes\":10", ""),
            top(one, "").replace("\"format\":1", "\"format\":2"),
            top(one, "").replace("\"format\":1", "\"format\":-1"),
            top(one, "").replace("\"total_samples\":3", "\"total_samples\":4"),
            top(&one.replace("\"size\":10,", ""), ""),
            top(&one.replace("\"url\":\"gs://b/a.tar\",", ""), ""),
            top(&one.replace("\"size\":10", "\"size\":10.0"), ""),
            top(&one.replace("\"size\":10", "\"size\":-10"), ""),
            top(&one.replace("\"size\":10", "\"size\":\"10\""), ""),
            top(&one.replace("\"crc32c\":1", "\"crc32c\":4294967296"), ""),
            top(
                &one.replace("\"samples\":3", "\"samples\":3,\"samples\":3"),
                "",
            ),
            top(&one.replace("\"url\":\"gs://b/a.tar\"", "\"url\":5"), ""),
            top(&one.replace("\"size\":10", "\"size\":10,\"e_tag\":5"), ""),
            top(
                &one.replace("\"size\":10", "\"size\":10,\"e_tag\":\"x\",\"e_tag\":\"x\""),
                "",
            ),
            top(
                &one.replace(
                    "\"url\":\"gs://b/a.tar\"",
                    "\"url\":\"gs://b/a.tar\",\"url\":\"gs://b/a.tar\"",
                ),
                "",
            ),
            top(
                &one.replace(
                    "\"size\":10",
                    "\"size\":10,\"generation\":\"1\",\"generation\":\"2\"",
                ),
                "",
            ),
            top(one, &format!(",\"shards\":[{one}]")),
            top(&format!("{one},"), ""),
            top("7", ""),
            top(one, "")
                .replace("\"shards\":[", "\"shards\":{")
                .replace("],", "},"),
        ];
        for text in cases {
            let derived = Manifest::parse(text.as_bytes(), "m.json").unwrap_err();
            let loaded = Loaded::parse(text.as_bytes(), "m.json", &shards).unwrap_err();
            assert_eq!(loaded.to_string(), derived.to_string(), "{text}");
            assert!(
                loaded.to_string().starts_with("manifest m.json: "),
                "{loaded}"
            );
        }
    }

    /// The usual forms are read by the streaming parser itself, not by the derived parser it
    /// falls back to (which builds the `Vec<Entry>` the columns are there to avoid): every
    /// key of both levels in any order, a null or missing ETag or generation, unknown keys.
    #[test]
    fn the_usual_forms_are_streamed() {
        let all = urls(&["gs://b/a.tar", "gs://b/b.tar", "gs://b/c.tar"]);
        let mut de = serde_json::Deserializer::from_slice(TEXT.as_bytes());
        let (format, l) = Top { shards: &all }.deserialize(&mut de).unwrap();
        de.end().unwrap();
        assert_eq!((format, l.total_samples, l.total_bytes), (1, 15, 60));
        let some = |s: &str| Some(s.to_string());
        let version = |size, e_tag, generation| Version {
            size,
            e_tag,
            generation,
        };
        assert_eq!(
            (0..l.len())
                .map(|i| (l.version(i), l.crc32c(i), l.samples(i)))
                .collect::<Vec<_>>(),
            [
                (version(10, some("x"), some("7")), 1, 3),
                (version(20, None, None), 2, 5),
                (version(30, None, some("\"9\"")), 3, 7),
            ]
        );
        assert!(l.urls.is_none());
    }

    /// The columns are allocated once, for the configured shards.
    #[test]
    fn strings_reserve_their_ends() {
        let s = Strings::with_capacity(1000);
        assert!(s.ends.capacity() >= 1000, "{}", s.ends.capacity());
    }

    #[test]
    fn urls_in_config_order_are_not_kept() {
        let all = urls(&["gs://b/a.tar", "gs://b/b.tar", "gs://b/c.tar"]);
        let l = Loaded::parse(TEXT.as_bytes(), "m.json", &all).unwrap();
        assert!(l.urls.is_none());
        let l = Loaded::parse(TEXT.as_bytes(), "m.json", &all[..2]).unwrap();
        assert_eq!(l.urls.as_ref().unwrap().get(2), Some("gs://b/c.tar"));
    }
}
