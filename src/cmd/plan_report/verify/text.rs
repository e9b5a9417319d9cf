//! The verification rendered as lines of text for `shardd plan --verify`. Its own module
//! because it reads only the finished `Verification` and nothing of how it was found.

use super::Verification;

/// The verification as lines of text.
pub fn text(v: &Verification) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let o = &v.from;
    let _ = writeln!(
        s,
        "verify: {} resumed from {} hosts × {} ranks × {} workers at positions {:?}{} onto {} \
         hosts × {} ranks × {} workers",
        v.dataset,
        o.hosts,
        o.world_size / o.hosts.max(1),
        o.num_workers,
        o.positions,
        if o.from.is_some() {
            " (a resume itself)"
        } else {
            ""
        },
        v.hosts,
        v.ranks,
        v.workers
    );
    for c in &v.sources {
        let _ = writeln!(
            s,
            "  {}: epoch {} samples, delivered {}, read by the new streams {}, duplicates {}, \
             foreign {}, unread {} (dropped, allowed up to {})",
            c.dataset,
            c.epoch,
            c.delivered,
            c.read,
            c.duplicates,
            c.foreign,
            c.unread,
            c.drop_allowance
        );
    }
    let workers: Vec<String> = (v.counts.workers.iter())
        .map(|(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}..{b}")
            }
        })
        .collect();
    let _ = writeln!(
        s,
        "  per rank: {} samples; per worker: {}",
        if v.counts.rank_min == v.counts.rank_max {
            v.counts.rank_min.to_string()
        } else {
            format!("{}..{}", v.counts.rank_min, v.counts.rank_max)
        },
        workers.join(", ")
    );
    if let Some(b) = &v.mix_bound {
        let _ = writeln!(
            s,
            "  mix prefix bound: worst {:.3} samples off, allowed ±{}",
            b.worst, b.bound
        );
    }
    if v.breaches.is_empty() {
        let _ = writeln!(
            s,
            "certified: every sample the old streams had not delivered is read exactly once ({} dropped)",
            v.planned_dropped
        );
    } else {
        for b in &v.breaches {
            let _ = writeln!(s, "BREACH {b}");
        }
    }
    s
}
