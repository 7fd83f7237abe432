//! Group commit of appends: the deliveries of lanes storing at once share one commit-log write and
//! sync (`schedulelog::Group`); each caller learns where its own messages went, or why none did.

use super::record::Incoming;
use super::store::Store;
use super::BrokerError;

/// Where each of a caller's messages went (queue, queue offset), or why none did.
pub(super) type Placed = Result<Vec<(u32, u64)>, BrokerError>;

/// A store and its queue of appends: each caller's messages, and where they went.
pub(super) type StoreGroup = schedulelog::Group<Store, Vec<Incoming>, Placed>;

/// One store append for the messages of every caller in a group: stored in the order they queued, each
/// caller gets where its own went. A caller whose topic cannot be created (its files cannot be made)
/// fails alone, before anything is written; any later failure (the commit log, a consume queue, a full
/// disk) undoes the append as a whole and fails every caller in it alike.
pub(super) fn append_together(store: &mut Store, works: Vec<Vec<Incoming>>) -> Vec<Placed> {
    let mut results: Vec<Option<Placed>> = works
        .iter()
        .map(|w| {
            let created = w.iter().try_for_each(|m| store.ensure_topic(&m.topic));
            created.err().map(Err)
        })
        .collect();
    let ready: Vec<usize> = (0..works.len()).filter(|&i| results[i].is_none()).collect();
    let all: Vec<&Incoming> = ready.iter().flat_map(|&i| &works[i]).collect();
    if !all.is_empty() {
        match append_to(store, &all) {
            Ok(placed) => {
                let mut placed = placed.into_iter();
                for &i in &ready {
                    results[i] = Some(Ok(placed.by_ref().take(works[i].len()).collect()));
                }
            }
            Err(e) => {
                for &i in &ready {
                    results[i] = Some(Err(e.duplicate()));
                }
            }
        }
    }
    results
        .into_iter()
        .map(|r| r.expect("every caller answered"))
        .collect()
}

/// Appends messages to a store, stamped with the latest time any of them was delivered.
fn append_to(store: &mut Store, messages: &[&Incoming]) -> Placed {
    let stored_at_ms = messages
        .iter()
        .map(|m| m.delivered_at_ms)
        .max()
        .unwrap_or(0);
    store.append(messages, stored_at_ms)
}
