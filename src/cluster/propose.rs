//! The leader's writes (DESIGN.md §10): a replicated schedule log queues its appends, cancels and
//! outcomes ([`schedulelog::Proposals`]); here each group of them becomes one entry, as a single node's
//! writer makes one WAL write of each group, and is proposed. Its submitters are answered once the entry
//! is committed and applied on this member.
//!
//! Invariants:
//! - One proposal at a time: the next group's seqs start where the log's handed-in entries end
//!   (`ScheduleLog::next_entry_seq`), which holds only once the proposal before it was appended or
//!   refused. Writes that come meanwhile form the next group.
//! - A failed proposal answers every submitter of its group with the same error. One that no quorum
//!   took in time (a leader cut off from the others) is answered as uncertain: its entry
//!   may still be committed (idempotency keys are for that). Until its fate is known, later writes are
//!   refused at once as not proposed (nothing stored).
//! - The proposer holds no strong handle on the log: the log closes when its owner lets it go, which
//!   ends the proposer.

use super::{Proposal, TypeConfig};
use schedulelog::{AppendError, Clock, EntryPayload, NextGroup, ScheduleLog};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How often an idle proposer looks whether its log is still there.
const IDLE_WAIT: Duration = Duration::from_millis(100);

/// Starts proposing `log`'s writes through `raft`, on a thread of its own driving `runtime`'s futures.
/// A group's submitters wait up to `answer_within` for its entry to be committed; then they are told
/// that no quorum took it (its fate is then unknown). `None` when the log has no proposals to give
/// (a single node's, or given already).
pub fn start(
    raft: openraft::Raft<TypeConfig>,
    log: &Arc<ScheduleLog>,
    clock: Arc<dyn Clock>,
    runtime: tokio::runtime::Handle,
    answer_within: Duration,
) -> std::io::Result<Option<std::thread::JoinHandle<()>>> {
    let Some(proposals) = log.proposals() else {
        return Ok(None);
    };
    let log = Arc::downgrade(log);
    let thread = std::thread::Builder::new()
        .name("delayd-propose".into())
        .spawn(move || loop {
            if log.strong_count() == 0 {
                return;
            }
            let next = || next_seq(&log).unwrap_or_default();
            let mut group = match proposals.next_group(next, &*clock, IDLE_WAIT) {
                NextGroup::Formed(group) => group,
                NextGroup::Idle => continue,
                NextGroup::Closed => return,
            };
            if log.strong_count() == 0 {
                return; // gone while the group formed (its seqs may be wrong): answered, not proposed
            }
            let EntryPayload::Normal(frames) = group.take_payload() else {
                unreachable!("a group forms a normal entry");
            };
            let mut write = Box::pin(raft.client_write(Proposal { frames }));
            // (The timer is made inside the runtime, which it needs.)
            let answered = async { tokio::time::timeout(answer_within, &mut write).await };
            let written = match runtime.block_on(answered) {
                Ok(written) => written,
                Err(_) => {
                    // A leader cut off from the others keeps its write pending: its submitters are
                    // told now; later writes are not proposed while its fate is open (their seqs
                    // would come after it), and are told so at once.
                    let seqs_below = group.next_seq;
                    group.answer(Err(AppendError::Uncertain { seqs_below }));
                    loop {
                        let settled = async { tokio::time::timeout(IDLE_WAIT, &mut write).await };
                        if runtime.block_on(settled).is_ok() {
                            break;
                        }
                        loop {
                            match proposals.next_group(|| 0, &*clock, Duration::ZERO) {
                                NextGroup::Formed(refused) => drop(refused), // answered: not proposed
                                NextGroup::Idle => break,
                                NextGroup::Closed => return,
                            }
                        }
                        if log.strong_count() == 0 {
                            return;
                        }
                    }
                    continue;
                }
            };
            let seqs_below = group.next_seq;
            let error = |e: openraft::error::RaftError<u64, _>| match e {
                e if e.forward_to_leader().is_some() => AppendError::NotLeader {
                    leader: e.forward_to_leader().and_then(|f| f.leader_id),
                },
                openraft::error::RaftError::Fatal(openraft::error::Fatal::Stopped) => {
                    AppendError::Closed
                }
                // Raft failed with the entry proposed: it may have reached the others.
                _ => AppendError::Uncertain { seqs_below },
            };
            group.answer(written.map(|_| ()).map_err(error));
        })?;
    Ok(Some(thread))
}

/// The seq the log's next entry starts at; `None` once the log is gone.
fn next_seq(log: &Weak<ScheduleLog>) -> Option<u64> {
    log.upgrade()?.next_entry_seq().ok()
}
