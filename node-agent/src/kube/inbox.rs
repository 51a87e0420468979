//! The node's attempts, read through its inbox: the ConfigMap the
//! controller keeps per node (genswap-controller's `inbox` module), one
//! entry per SwapAttempt of the node, uid → `<namespace>/<name>`.
//!
//! A watch of one object by name is what the API server's watch cache
//! indexes; a `spec.nodeName` field selector on SwapAttempts is matched
//! against every attempt event, once per agent in the fleet
//! (docs/BENCHMARKS.md, "Watch fan-out"). [`attempts_from_inbox`] turns the
//! inbox's watch into the events the SwapAttempt watch would have given,
//! so the agent after it is the same:
//!
//! - an entry that appears is read with a GET (a quorum read, as the
//!   watch's `MostRecent` list was) and delivered as `Apply`; an entry
//!   whose attempt is gone or was re-created under another uid is skipped
//!   (the controller replaces or removes it);
//! - an entry that disappears is delivered as `Delete` of the attempt last
//!   read for it;
//! - a (re)list of the inbox reads every entry again, between `Init` and
//!   `InitDone`. A missing inbox is an empty one.
//!
//! Attempts are not watched after their GET: the agent itself writes the
//! status of its attempts, and their specs never change. A failed GET is
//! yielded as an error and retried on the next poll (the caller's backoff
//! spaces them).

use std::collections::{BTreeMap, HashMap, VecDeque};

use futures::stream::{self, BoxStream};
use futures::{Stream, StreamExt, TryStreamExt};
use genswap_core::scheduler::{inbox_name, parse_inbox_entry};
use genswap_crds::SwapAttempt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kube::runtime::watcher;
use kube::{Client, ResourceExt};

/// GETs in flight at once while an inbox is (re)listed.
const READS_AT_ONCE: usize = 16;

/// Where the inbox lives and what of it this agent takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InboxSource {
    /// The controller's namespace, which holds the inboxes.
    pub inbox_namespace: String,
    pub node_name: String,
    /// Only attempts in this namespace; `None` takes every entry.
    pub attempts_namespace: Option<String>,
}

/// The node's SwapAttempt events, read through its inbox.
pub fn attempts_from_inbox(
    client: Client,
    source: InboxSource,
) -> impl Stream<Item = watcher::Result<watcher::Event<SwapAttempt>>> + Send {
    let inboxes: Api<ConfigMap> = Api::namespaced(client.clone(), &source.inbox_namespace);
    let selector = format!("metadata.name={}", inbox_name(&source.node_name));
    let watch = watcher(inboxes, watcher::Config::default().fields(&selector)).boxed();
    let state = State {
        client,
        attempts_namespace: source.attempts_namespace,
        watch,
        known: HashMap::new(),
        listing: None,
        work: None,
        out: VecDeque::new(),
    };
    stream::unfold(state, |mut state| async move {
        let item = state.next().await?;
        Some((item, state))
    })
}

/// uid → (namespace, name), as an inbox lists them.
type Entries = BTreeMap<String, (String, String)>;

/// What is left to read before the events can go out.
enum Work {
    /// A relist's entries: all are read, then `InitApply` each and `InitDone`.
    Relist(Entries),
    /// An update's new entries.
    Added(Entries),
}

struct State {
    client: Client,
    attempts_namespace: Option<String>,
    watch: BoxStream<'static, watcher::Result<watcher::Event<ConfigMap>>>,
    /// The attempts delivered and not deleted, by uid.
    known: HashMap<String, SwapAttempt>,
    /// The inbox seen during a relist (`None` outside one; empty until
    /// the inbox itself arrives).
    listing: Option<Option<ConfigMap>>,
    /// Reads still to make; kept across a failed GET so it is retried.
    work: Option<Work>,
    out: VecDeque<watcher::Event<SwapAttempt>>,
}

impl State {
    async fn next(&mut self) -> Option<watcher::Result<watcher::Event<SwapAttempt>>> {
        loop {
            if let Some(event) = self.out.pop_front() {
                return Some(Ok(event));
            }
            if let Some(work) = self.work.take() {
                if let Err(error) = self.finish(work).await {
                    return Some(Err(error));
                }
                continue;
            }
            match self.watch.next().await? {
                Err(error) => return Some(Err(error)),
                Ok(event) => self.on_inbox(event),
            }
        }
    }

    fn on_inbox(&mut self, event: watcher::Event<ConfigMap>) {
        match event {
            watcher::Event::Init => {
                self.listing = Some(None);
                self.out.push_back(watcher::Event::Init);
            }
            watcher::Event::InitApply(inbox) => self.listing = Some(Some(inbox)),
            watcher::Event::InitDone => {
                let inbox = self.listing.take().flatten();
                self.work = Some(Work::Relist(self.entries(inbox.as_ref())));
            }
            watcher::Event::Apply(inbox) => {
                let entries = self.entries(Some(&inbox));
                self.remove_all_but(&entries);
                let added: Entries = entries
                    .into_iter()
                    .filter(|(uid, _)| !self.known.contains_key(uid))
                    .collect();
                if !added.is_empty() {
                    self.work = Some(Work::Added(added));
                }
            }
            watcher::Event::Delete(_) => self.remove_all_but(&Entries::new()),
        }
    }

    /// Delivers `Delete` for every known attempt `entries` no longer lists.
    fn remove_all_but(&mut self, entries: &Entries) {
        let gone: Vec<String> = self
            .known
            .keys()
            .filter(|uid| !entries.contains_key(*uid))
            .cloned()
            .collect();
        for uid in gone {
            if let Some(attempt) = self.known.remove(&uid) {
                self.out.push_back(watcher::Event::Delete(attempt));
            }
        }
    }

    fn entries(&self, inbox: Option<&ConfigMap>) -> Entries {
        let Some(data) = inbox.and_then(|inbox| inbox.data.as_ref()) else {
            return Entries::new();
        };
        data.iter()
            .filter_map(|(uid, value)| {
                let (namespace, name) = parse_inbox_entry(value)?;
                let wanted = self
                    .attempts_namespace
                    .as_deref()
                    .is_none_or(|only| only == namespace);
                wanted.then(|| (uid.clone(), (namespace.to_string(), name.to_string())))
            })
            .collect()
    }

    /// Reads every entry of `work`, then queues its events. On a failed
    /// read nothing is queued and `work` is kept for the next poll.
    async fn finish(&mut self, work: Work) -> watcher::Result<()> {
        let entries = match &work {
            Work::Relist(entries) | Work::Added(entries) => entries.clone(),
        };
        let read = stream::iter(entries.into_iter().map(|(uid, (namespace, name))| {
            let attempts: Api<SwapAttempt> = Api::namespaced(self.client.clone(), &namespace);
            async move {
                let found = attempts.get_opt(&name).await?;
                // Another uid: the entry's attempt is gone and a new one
                // took its name; the controller's next write names it.
                Ok::<_, kube::Error>(found.filter(|attempt| attempt.uid().as_deref() == Some(&uid)))
            }
        }))
        .buffered(READS_AT_ONCE)
        .try_collect::<Vec<_>>()
        .await;
        let read = match read {
            Ok(read) => read,
            Err(error) => {
                let relist = matches!(work, Work::Relist(_));
                self.work = Some(work);
                return Err(if relist {
                    watcher::Error::InitialListFailed(error)
                } else {
                    watcher::Error::WatchFailed(error)
                });
            }
        };
        let found = read.into_iter().flatten();
        match work {
            Work::Relist(_) => {
                self.known.clear();
                for attempt in found {
                    if let Some(uid) = attempt.uid() {
                        self.known.insert(uid, attempt.clone());
                    }
                    self.out.push_back(watcher::Event::InitApply(attempt));
                }
                self.out.push_back(watcher::Event::InitDone);
            }
            Work::Added(_) => {
                for attempt in found {
                    if let Some(uid) = attempt.uid() {
                        self.known.insert(uid, attempt.clone());
                    }
                    self.out.push_back(watcher::Event::Apply(attempt));
                }
            }
        }
        Ok(())
    }
}
