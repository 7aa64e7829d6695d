//! Choosing the content of a shared-state sync round (pure, so it is unit-tested on its
//! own): the highest revision among the members whose content counts, and at that
//! revision the content most of them hold.

use std::collections::BTreeMap;

use eccl_protocol::{PeerId, SyncStrategy, TensorDigest};

/// One member's report.
#[derive(Clone, Debug)]
pub struct Report {
    pub peer: PeerId,
    /// The member's count of syncs in the epoch (see `PeerRequest::SyncState`).
    pub round: u64,
    pub revision: u64,
    pub role: SyncStrategy,
    pub tensors: Vec<TensorDigest>,
}

impl Report {
    /// What identifies this report in a decided round: who, which round, and a blake3
    /// of what it held.
    pub fn input(&self) -> (PeerId, u64, [u8; 32]) {
        let mut h = blake3::Hasher::new();
        h.update(&self.revision.to_le_bytes());
        h.update(format!("{:?}", self.role).as_bytes());
        for t in &self.tensors {
            h.update(&(t.name.len() as u64).to_le_bytes());
            h.update(t.name.as_bytes());
            h.update(&t.len.to_le_bytes());
            h.update(&t.hash);
        }
        (self.peer, self.round, *h.finalize().as_bytes())
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub revision: u64,
    pub target: Vec<TensorDigest>,
    pub sources: Vec<PeerId>,
    pub receivers: Vec<PeerId>,
}

/// What identifies a member's content: names, lengths and hashes of its tensors.
fn content(r: &Report) -> Vec<(&str, u64, [u8; 32])> {
    r.tensors
        .iter()
        .map(|t| (t.name.as_str(), t.len, t.hash))
        .collect()
}

/// Send-only members are authoritative when there are any; otherwise the members that
/// enforce the popular state vote; if everyone only receives, everyone's content counts.
/// Ties go to the content held by the smallest peer id, so every master decides alike.
pub fn plan(reports: &[Report]) -> Option<Plan> {
    let by_role = |role| reports.iter().filter(move |r| r.role == role);
    let mut voters: Vec<&Report> = by_role(SyncStrategy::SendOnly).collect();
    if voters.is_empty() {
        voters = by_role(SyncStrategy::EnforcePopular).collect();
    }
    if voters.is_empty() {
        voters = reports.iter().collect();
    }
    let revision = voters.iter().map(|r| r.revision).max()?;
    let mut votes: BTreeMap<Vec<(&str, u64, [u8; 32])>, (usize, PeerId, &Report)> = BTreeMap::new();
    for r in voters.iter().filter(|r| r.revision == revision) {
        let e = votes.entry(content(r)).or_insert((0, r.peer, r));
        e.0 += 1;
        if r.peer < e.1 {
            e.1 = r.peer;
        }
    }
    let (key, (_, _, winner)) = votes
        .iter()
        .max_by(|a, b| a.1 .0.cmp(&b.1 .0).then(b.1 .1.cmp(&a.1 .1)))?;
    let mut sources = Vec::new();
    let mut receivers = Vec::new();
    for r in reports {
        if &content(r) == key {
            if r.role != SyncStrategy::ReceiveOnly {
                sources.push(r.peer);
            }
        } else {
            receivers.push(r.peer);
        }
    }
    sources.sort_unstable();
    receivers.sort_unstable();
    Some(Plan {
        revision,
        target: winner.tensors.clone(),
        sources,
        receivers,
    })
}
