//! The leader's writes (DESIGN.md §10): a replicated schedule log queues its appends, cancels and
//! outcomes ([`schedulelog::Proposals`]); here each group of them becomes one entry, as a single node's
//! writer makes one WAL write of each group, and is proposed. Its submitters are answered once the entry
//! is committed and applied on this member.
//!
//! Invariants:
//! - One proposal at a time: the next group's seqs start where the log's handed-in entries end
//!   (`ScheduleLog::next_entry_seq`), which holds only once the proposal before it was appended or
//!   refused. Writes that come meanwhile form the next group.
//! - A failed proposal answers every submitter of its group with the same error, and so does one that
//!   no quorum took within `ANSWER_WITHIN` (a leader cut off from the others). Its entry may still be
//!   committed later (the answer is then unknown, as for any timed-out write: idempotency keys are
//!   for that).
//! - The proposer holds no strong handle on the log: the log closes when its owner lets it go, which
//!   ends the proposer.

use super::{Proposal, TypeConfig};
use schedulelog::{AppendError, Clock, EntryPayload, NextGroup, ScheduleLog};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How often an idle proposer looks whether its log is still there.
const IDLE_WAIT: Duration = Duration::from_millis(100);

/// How long a group's submitters wait for its entry to be committed before they are told that no
/// quorum took it (its fate is then unknown).
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

/// Starts proposing `log`'s writes through `raft`, on a thread of its own driving `runtime`'s futures.
/// `None` when the log has no proposals to give (a single node's, or given already).
pub fn start(
    raft: openraft::Raft<TypeConfig>,
    log: &Arc<ScheduleLog>,
    clock: Arc<dyn Clock>,
    runtime: tokio::runtime::Handle,
) -> std::io::Result<Option<std::thread::JoinHandle<()>>> {
    let Some(proposals) = log.proposals() else {
        return Ok(None);
    };
    let log = Arc::downgrade(log);
    let thread = std::thread::Builder::new()
        .name("delayd-propose".into())
        .spawn(move || loop {
            let Some(next_seq) = next_seq(&log) else {
                return;
            };
            let mut group = match proposals.next_group(next_seq, &*clock, IDLE_WAIT) {
                NextGroup::Formed(group) => group,
                NextGroup::Idle => continue,
                NextGroup::Closed => return,
            };
            let EntryPayload::Normal(frames) = group.take_payload() else {
                unreachable!("a group forms a normal entry");
            };
            let mut write = Box::pin(raft.client_write(Proposal { frames }));
            // (The timer is made inside the runtime, which it needs.)
            let answered = async { tokio::time::timeout(ANSWER_WITHIN, &mut write).await };
            let written = match runtime.block_on(answered) {
                Ok(written) => written,
                Err(_) => {
                    // A leader cut off from the others keeps its write pending: its submitters are
                    // told now, and the next group waits for this one's fate (its seqs come after).
                    group.answer(Err(AppendError::NotLeader { leader: None }));
                    let _ = runtime.block_on(write);
                    continue;
                }
            };
            let error = |e: openraft::error::RaftError<u64, _>| match e.forward_to_leader() {
                Some(forward) => AppendError::NotLeader {
                    leader: forward.leader_id,
                },
                None => AppendError::Refused(format!("the write through Raft failed: {e}")),
            };
            group.answer(written.map(|_| ()).map_err(error));
        })?;
    Ok(Some(thread))
}

/// The seq the log's next entry starts at; `None` once the log is gone.
fn next_seq(log: &Weak<ScheduleLog>) -> Option<u64> {
    log.upgrade()?.next_entry_seq().ok()
}
