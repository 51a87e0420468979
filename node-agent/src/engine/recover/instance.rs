//! One instance's recovery: what its journal entry and the host show,
//! reconciled by [`super::decide`] into one serving generation (or none),
//! adopted into the engine.

use super::*;

impl Engine {
    pub(super) async fn recover_instance(
        &self,
        key: InstanceKey,
        found: Found,
        journal_readable: bool,
    ) -> InstanceWork {
        let mut work = InstanceWork {
            recovery: InstanceRecovery {
                instance: key.clone(),
                serving: None,
                attempt: None,
                stopped: Vec::new(),
                current_fixed: false,
                parent_restored: false,
            },
            untracked: Vec::new(),
            removed: Vec::new(),
            errors: Vec::new(),
        };
        // Recovery is for what a previous process left. An instance this
        // engine already runs or swaps (recovery called late, or twice) is
        // its own, and is left alone.
        if let Some(state) = self.lock_instances().get(&key)
            && (state.busy || state.serving.is_some())
        {
            tracing::warn!(instance = %key, "recovery skips an instance this engine already runs");
            work.recovery.serving = state.info.clone();
            return work;
        }
        let run_dir = self.layout.instance_dir(&key);
        match remove_temp_links(&run_dir) {
            Ok(0) => {}
            Ok(_) => work
                .removed
                .push(run_dir.join(format!("{CURRENT_SOCKET}.tmp-*"))),
            Err(source) => work.errors.push(RecoveryError::Remove {
                path: run_dir.clone(),
                source,
            }),
        }
        let listing = found.listing;
        let generations: BTreeMap<u64, GenerationListing> = listing
            .iter()
            .flat_map(|l| l.generations.iter().cloned())
            .map(|g| (g.generation, g))
            .collect();
        let sockets = match self.layout.generation_sockets(&key) {
            Ok(sockets) => sockets,
            Err(source) => {
                work.errors.push(RecoveryError::RunDir {
                    path: run_dir.clone(),
                    source,
                });
                Vec::new()
            }
        };
        let host = HostView {
            live: generations
                .values()
                .filter(|g| g.populated)
                .map(|g| g.generation)
                .collect(),
            current: current_generation(&run_dir),
        };

        if !journal_readable {
            // Never act on a guess: adopt what current.sock names, touch
            // nothing else.
            if let Some(n) = host.current.filter(|n| host.live.contains(n))
                && let Some(listing) = generations.get(&n)
                && let Some(record) = record_from_host(&self.layout, &key, listing)
            {
                self.adopt(
                    &key,
                    record,
                    listing,
                    Adoption {
                        kind: InstanceKind::Instance,
                        preferred_pid: None,
                        lineage: None,
                    },
                    &mut work,
                );
            }
            return work;
        }

        // The counter stays above every number the host shows (an instance
        // the journal does not know gets no journal file for it).
        let journaled = found.entry.is_some() || found.quarantined;
        if journaled && let Some(highest) = generations.keys().chain(sockets.iter()).max().copied()
        {
            let journal = Arc::clone(&self.journal);
            let owned = key.clone();
            if let Err(source) =
                parts::blocking(move || journal.observe_generation(&owned, highest)).await
            {
                work.errors.push(RecoveryError::JournalWrite {
                    instance: key.clone(),
                    source,
                });
            }
        }

        let entry = found.entry;
        let in_flight = entry
            .as_ref()
            .and_then(|e| e.attempt.clone())
            .filter(|r| r.outcome.is_none());
        // The listeners the attempt in flight handed its successor.
        let successor_listeners = in_flight.as_ref().and_then(|r| {
            let n = r.successor.as_ref()?.n;
            Some((n, r.spec.as_deref()?.listeners.clone()))
        });
        let kind = entry
            .as_ref()
            .and_then(|e| e.attempt.as_ref().or(e.unreported.last()))
            .map_or(InstanceKind::Instance, |r| r.kind);
        // Generations the journal describes: stopping one is not
        // "untracked".
        let described: BTreeSet<u64> = entry
            .iter()
            .flat_map(|e| {
                let attempt = e.attempt.as_ref();
                [
                    e.serving.as_ref(),
                    attempt.and_then(|r| r.incumbent.as_ref()),
                    attempt.and_then(|r| r.successor.as_ref()),
                ]
            })
            .flatten()
            .map(|g| g.n)
            .collect();

        let decision = in_flight.as_ref().map(|record| decide(record, &host));
        let keep: Option<GenerationRecord> = match (&decision, &entry) {
            (Some(decision), _) => decision.keep.clone(),
            (None, Some(entry)) => settled_serving(entry, &host),
            (None, None) if found.quarantined => host
                .current
                .filter(|n| host.live.contains(n))
                .and_then(|n| generations.get(&n))
                .and_then(|listing| record_from_host(&self.layout, &key, listing)),
            (None, None) => None,
        };
        let keep_n = keep.as_ref().map(|g| g.n);
        let stop = in_flight
            .as_ref()
            .and_then(|r| r.stop.clone())
            .unwrap_or_default();

        // The spec that started the generation kept: the attempt's in
        // flight if it is its successor, else the lineage's.
        let lineage = entry
            .as_ref()
            .and_then(|e| e.supervised.as_ref())
            .map(|s| &s.spec);
        let kept_listeners = keep
            .as_ref()
            .and_then(|kept| {
                successor_listeners
                    .as_ref()
                    .filter(|(n, _)| *n == kept.n)
                    .map(|(_, listeners)| listeners.clone())
            })
            .or_else(|| lineage.map(|spec| spec.listeners.clone()))
            .unwrap_or_default();
        let kept_pid = keep.as_ref().and_then(|kept| {
            let listing = generations.get(&kept.n).filter(|l| l.populated)?;
            let preferred = record_successor_pid(entry.as_ref(), kept.n);
            Some(serving_pid(listing, kept.n, lineage, preferred))
        });
        // The listeners come back before any other generation stops: an
        // agent killed between `current.sock` and the steering map left the
        // map on the generation about to stop, and a datagram queued on its
        // socket then would go with it (a queued connection would move).
        if let Some(pid) = kept_pid {
            for problem in self.listeners.take_back(&key, pid, &kept_listeners) {
                tracing::debug!(instance = %key, %problem, "a listener the serving generation does not hold");
            }
        }
        // The keeper holds them even when no generation does (an agent
        // killed in a hold's gap); a fresh keeper then holds what is held.
        let specs = journaled_listeners(entry.as_ref());
        for problem in self.listeners.take_back_from_keeper(&key, &specs).await {
            tracing::warn!(instance = %key, %problem, "a listener could not be taken back; the next attempt binds it anew");
        }

        // Every other live generation stops; empty ones and their sockets go.
        let mut notes = Vec::new();
        let mut drain = None;
        for (n, listing) in &generations {
            if Some(*n) == keep_n {
                continue;
            }
            let socket = self.layout.generation_socket(&key, *n);
            if listing.populated {
                let tracked = described.contains(n);
                match stop_generation(listing, &stop).await {
                    Ok(stopped) => {
                        if tracked {
                            if stopped.killed {
                                notes.push(format!(
                                    "generation {n} did not stop within {}s of the stop signal; its cgroup was killed",
                                    stop.timeout_seconds
                                ));
                            }
                            if record_is_incumbent(in_flight.as_ref(), *n) {
                                drain = Some(stopped.drain);
                            }
                            work.recovery.stopped.push(StoppedGeneration {
                                generation: *n,
                                cgroup: listing.cgroup.path().to_path_buf(),
                                pids: listing.pids.clone(),
                                killed: stopped.killed,
                            });
                        } else {
                            tracing::warn!(instance = %key, generation = n, pids = ?listing.pids, "a generation no journal entry describes was running; stopped");
                            work.untracked.push(UntrackedCgroup {
                                cgroup: listing.cgroup.path().to_path_buf(),
                                pids: listing.pids.clone(),
                                stopped: true,
                            });
                        }
                    }
                    Err(source) => {
                        notes.push(format!(
                            "generation {n} could not be proven stopped: {}",
                            reason_of(&source)
                        ));
                        if !tracked {
                            work.untracked.push(UntrackedCgroup {
                                cgroup: listing.cgroup.path().to_path_buf(),
                                pids: listing.pids.clone(),
                                stopped: false,
                            });
                        }
                        work.errors.push(RecoveryError::Stop {
                            cgroup: listing.cgroup.path().to_path_buf(),
                            source,
                        });
                        continue;
                    }
                }
            }
            match listing.cgroup.remove() {
                Ok(()) => work.removed.push(listing.cgroup.path().to_path_buf()),
                Err(source) => work.errors.push(RecoveryError::RemoveCgroup {
                    path: listing.cgroup.path().to_path_buf(),
                    source,
                }),
            }
            if socket.exists() {
                work.removed.push(socket.clone());
            }
            parts::remove_generation_files(&socket);
        }
        for n in &sockets {
            if Some(*n) != keep_n && !generations.contains_key(n) {
                let socket = self.layout.generation_socket(&key, *n);
                parts::remove_generation_files(&socket);
                work.removed.push(socket);
            }
        }
        // A generation that never bound its socket left only its /tmp.
        for n in self
            .layout
            .generation_private_dirs(&key)
            .unwrap_or_default()
        {
            if Some(n) != keep_n && !generations.contains_key(&n) && !sockets.contains(&n) {
                let socket = self.layout.generation_socket(&key, n);
                parts::remove_generation_files(&socket);
                work.removed
                    .push(crate::confine::filesystem::private_dir_of(&socket));
            }
        }

        // current.sock names the one generation that serves, or nothing.
        match &keep {
            Some(kept) if host.current != Some(kept.n) => {
                // Proven healthy before the crash, by whichever probe.
                match point_current_allowing_unbound(&run_dir, &kept.socket) {
                    Ok(()) => work.recovery.current_fixed = true,
                    Err(source) => work.errors.push(RecoveryError::Switch {
                        instance: key.clone(),
                        generation: kept.n,
                        source,
                    }),
                }
            }
            Some(_) => {}
            None => {
                let link = run_dir.join(CURRENT_SOCKET);
                if fs::symlink_metadata(&link).is_ok() {
                    parts::remove_current_link(&self.layout, &key);
                    work.recovery.current_fixed = true;
                    work.removed.push(link);
                }
            }
        }

        // Parent limits go back only now that the extra generation has left.
        if let Some(saved) = in_flight.as_ref().and_then(|r| r.raised_parent.as_ref()) {
            let instance = self.cgroups.instance_handle(&key);
            let raise = raise_record(instance.path(), saved);
            match raise.restore() {
                Ok(()) => work.recovery.parent_restored = true,
                Err(source) => {
                    notes.push(format!(
                        "the instance cgroup's raised limits could not be restored: {}",
                        reason_of(&source)
                    ));
                    work.errors.push(RecoveryError::Restore {
                        path: instance.path().to_path_buf(),
                        source,
                    });
                }
            }
        }
        // An overlap that completed leaves the instance cgroup on the new
        // tier, as the engine would have.
        if let (Some(decision), Some(kept)) = (&decision, &keep)
            && decision.outcome == Outcome::Done
            && in_flight
                .as_ref()
                .is_some_and(|r| r.effective_mode == Mode::Overlap)
            && let Err(error) = self
                .cgroups
                .instance_handle(&key)
                .apply_tier(&tier_of(&kept.cgroup))
        {
            notes.push(reason_of(&error));
        }

        // The journal: what serves, then the outcome, last.
        let mut serving_record = keep.clone();
        if let Some(record) = serving_record.as_mut()
            && record.serving_since_ms.is_none()
        {
            record.serving_since_ms = Some(unix_millis_now());
        }
        let needs_serving_write = in_flight.is_some()
            || found.quarantined
            || entry.as_ref().map(|e| e.serving.as_ref().map(|g| g.n)) != Some(keep_n);
        // The journal's serving generation is gone and nothing was in
        // flight: it died while no agent ran. Say so, not only that
        // nothing serves (its exit status died with the agent).
        let died_away = match (
            &in_flight,
            &keep,
            entry.as_ref().and_then(|e| e.serving.as_ref()),
        ) {
            (None, None, Some(gone)) => Some(ExitRecord {
                generation: gone.n,
                build: gone.build.clone(),
                exit_code: None,
                signal: None,
                oom_killed: false,
                at_ms: unix_millis_now(),
                serving_since_ms: gone.serving_since_ms,
                liveness_failed: None,
            }),
            _ => None,
        };
        if needs_serving_write && (entry.is_some() || found.quarantined || keep.is_some()) {
            let journal = Arc::clone(&self.journal);
            let owned = key.clone();
            let serving = serving_record.clone();
            let write = move || match died_away {
                Some(exit) => journal.record_exit(&owned, exit),
                None => journal.set_serving(&owned, serving),
            };
            if let Err(source) = parts::blocking(write).await {
                work.errors.push(RecoveryError::JournalWrite {
                    instance: key.clone(),
                    source,
                });
            }
        }
        if let (Some(mut record), Some(decision)) = (in_flight, decision) {
            let mut reason = decision.reason;
            for note in notes {
                reason.push_str("; ");
                reason.push_str(&note);
            }
            let outcome = OutcomeRecord {
                outcome: decision.outcome,
                effective_mode: record.effective_mode,
                generation: record.successor.as_ref().map(|g| g.n),
                reason,
                executed: decision.executed,
                clean_exit: false,
                drain_ms: drain.map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
                listener_handover: None,
                steps: Vec::new(),
                started_at_ms: record.started_at_ms,
                finished_at_ms: unix_millis_now(),
            };
            let phase = record.phase.name();
            if work.recovery.parent_restored {
                record.parent_restored();
            }
            record.finish(outcome.clone());
            tracing::info!(
                instance = %key,
                attempt = %record.attempt.name,
                phase,
                outcome = ?outcome.outcome,
                executed = outcome.executed,
                reason = %outcome.reason,
                "recovered an attempt left in flight"
            );
            let journal = Arc::clone(&self.journal);
            let to_write = record.clone();
            let lineage = record.lineage_after(serving_record.as_ref().map(|g| g.n));
            if let Err(source) = parts::blocking(move || journal.finish(&to_write, lineage)).await {
                work.errors.push(RecoveryError::JournalWrite {
                    instance: key.clone(),
                    source,
                });
            }
            work.recovery.attempt = Some(RecoveredAttempt {
                attempt: record.attempt,
                phase,
                outcome,
            });
        }

        if let Some(kept) = serving_record
            && let Some(listing) = generations.get(&kept.n)
        {
            let found = Adoption {
                kind,
                preferred_pid: record_successor_pid(entry.as_ref(), kept.n),
                lineage,
            };
            let kept_n = kept.n;
            self.adopt(&key, kept, listing, found, &mut work);
            self.restart_sidecars(&key, kept_n).await;
        }
        self.listeners.refresh_keeper(&key).await;

        // An instance the journal knows nothing of and that runs nothing
        // leaves no directory behind.
        if entry.is_none() && !found.quarantined && work.recovery.serving.is_none() {
            if let Some(listing) = &listing
                && listing.others.is_empty()
            {
                match Cgroup::at(&listing.path, self.cgroups.mount()).remove() {
                    Ok(()) => work.removed.push(listing.path.clone()),
                    Err(source) => work.errors.push(RecoveryError::RemoveCgroup {
                        path: listing.path.clone(),
                        source,
                    }),
                }
            }
            let existed = run_dir.exists();
            match self.layout.remove_instance_dir(&key) {
                Ok(()) if existed => work.removed.push(run_dir.clone()),
                Ok(()) => {}
                Err(source) => work.errors.push(RecoveryError::Remove {
                    path: run_dir.clone(),
                    source,
                }),
            }
        }
        // Child cgroups that are no generation are never genswap's.
        for other in listing.iter().flat_map(|l| l.others.iter()) {
            let mut sub = RecoveryReport::default();
            self.stop_untracked(other, &mut sub).await;
            work.untracked.extend(sub.untracked);
            work.removed.extend(sub.removed);
            work.errors.extend(sub.errors);
        }
        work
    }

    /// The cgroup tree, after the commands an earlier agent ran against its
    /// generations (exec probes, hooks) are killed with proof (SPEC 5.12):
    /// they are never adopted, and no generation looks alive for them.
    pub(super) async fn list_without_commands(
        &self,
    ) -> Result<Vec<crate::cgroup::InstanceListing>, crate::cgroup::CgroupError> {
        let listings = self.cgroups.list()?;
        let mut killed = 0;
        for generation in listings.iter().flat_map(|listing| &listing.generations) {
            match crate::command::kill_commands(&generation.cgroup).await {
                Ok(n) => killed += n,
                Err(error) => tracing::error!(
                    cgroup = %generation.cgroup.path().display(),
                    error = %reason_of(&error),
                    "a command an earlier agent left could not be proven gone"
                ),
            }
            // Its sidecars are started anew for a kept generation, after it
            // is adopted: none is adopted, and none outlives a generation
            // recovery stops (SPEC 5.13).
            match crate::engine::sidecars::kill_sidecars(&generation.cgroup).await {
                Ok(n) => killed += n,
                Err(error) => tracing::error!(
                    cgroup = %generation.cgroup.path().display(),
                    error = %reason_of(&error),
                    "a sidecar an earlier agent left could not be proven gone"
                ),
            }
        }
        if killed == 0 {
            return Ok(listings);
        }
        tracing::info!(
            killed,
            "recovery killed the commands an earlier agent left running"
        );
        self.cgroups.list()
    }

    /// Starts the sidecars of the adopted generation `n` as the journal's
    /// lineage (written by this recovery) names them.
    async fn restart_sidecars(&self, key: &InstanceKey, n: u64) {
        let journal = Arc::clone(&self.journal);
        let instance = key.clone();
        let spec = match parts::blocking(move || journal.load_entry(&instance)).await {
            Ok(entry) => entry
                .and_then(|e| e.supervised)
                .filter(|s| s.generation == n)
                .map(|s| s.spec),
            Err(error) => {
                tracing::error!(instance = %key, error = %reason_of(&error), "the journal cannot be read: the adopted generation's sidecars are not started");
                None
            }
        };
        if let Some(spec) = spec {
            self.start_serving_sidecars(key, &spec);
        }
    }

    /// Makes `record` the instance's serving generation in the engine, with
    /// its main process found in its cgroup.
    pub(super) fn adopt(
        &self,
        key: &InstanceKey,
        record: GenerationRecord,
        listing: &GenerationListing,
        found: Adoption<'_>,
        work: &mut InstanceWork,
    ) {
        let Adoption {
            kind,
            preferred_pid,
            lineage,
        } = found;
        let pid = serving_pid(listing, record.n, lineage, preferred_pid);
        let mut running = Running {
            tier: tier_of(listing.cgroup.path()),
            cgroup: listing.cgroup.clone(),
            kind,
            process: Process::Adopted { pid },
            notify: None,
            liveness: None,
            liveness_task: None,
            pre_stop: None,
            pid_file: None,
            sidecars: None,
            record,
        };
        if let Some(spec) = lineage {
            // Its NOTIFY_SOCKET is bound again at the same path, which the
            // generation's next message finds: its watchdog is still heard.
            match parts::bind_notify(self, key, spec, running.record.n, &running.cgroup) {
                Ok(notify) => running.notify = notify,
                Err(error) => {
                    tracing::warn!(instance = %key, generation = running.record.n, error = %crate::engine::flow::reason_of(&error), "the adopted generation's notify socket cannot be bound again")
                }
            }
            running.pre_stop = crate::engine::lifecycle::PreStop::of(self, key, spec, &running);
        }
        // Probed again as its lineage asks: an agent restart does not end it.
        running.liveness = lineage.and_then(|spec| parts::liveness_of(self, key, spec, &running));
        let info = running.serving();
        let mut instances = self.lock_instances();
        let state = instances.entry(key.clone()).or_default();
        if state.busy {
            work.errors.push(RecoveryError::Busy {
                instance: key.clone(),
                generation: info.generation,
            });
            return;
        }
        tracing::info!(instance = %key, generation = info.generation, pid, build = %info.build, "adopted the serving generation");
        state.info = Some(info.clone());
        state.serving = Some(running);
        self.watch_serving(key, state);
        work.recovery.serving = Some(info);
    }
}

/// The main process of generation `n` in `listing`: the one its daemon's
/// pid file names (better than the pid journaled at the exec, which was its
/// start's), else `preferred`, else the cgroup's root process.
fn serving_pid(
    listing: &GenerationListing,
    n: u64,
    lineage: Option<&genswap_crds::SwapAttemptSpec>,
    preferred: Option<u32>,
) -> u32 {
    let named = lineage
        .and_then(crate::engine::lifecycle::pid_file_of)
        .and_then(|file| crate::engine::lifecycle::named_process(&file, &listing.cgroup).ok());
    main_pid(&listing.pids, n, named.or(preferred))
}

/// The serving generation of an instance with no attempt in flight: the
/// journal's, while it runs. A generation the last finished attempt made
/// serve is taken when the journal could not record it and `current.sock`
/// names it.
/// Every listener the journal says the instance may hold: its lineage's
/// and its newest attempt's.
pub(super) fn journaled_listeners(entry: Option<&InstanceEntry>) -> Vec<ListenerSpec> {
    let mut specs: Vec<ListenerSpec> = Vec::new();
    let Some(entry) = entry else {
        return specs;
    };
    let lineage = entry.supervised.iter().map(|s| &s.spec.listeners);
    let attempt = entry
        .attempt
        .iter()
        .filter_map(|r| r.spec.as_deref())
        .map(|spec| &spec.listeners);
    for spec in lineage.chain(attempt).flatten() {
        if !specs.contains(spec) {
            specs.push(spec.clone());
        }
    }
    specs
}

pub(super) fn settled_serving(entry: &InstanceEntry, host: &HostView) -> Option<GenerationRecord> {
    if let Some(serving) = &entry.serving {
        return host.live.contains(&serving.n).then(|| serving.clone());
    }
    let finished = entry.attempt.as_ref()?;
    let successor = finished.successor.as_ref()?;
    let done = finished
        .outcome
        .as_ref()
        .is_some_and(|o| o.outcome == Outcome::Done && !o.clean_exit);
    (done && host.current == Some(successor.n) && host.live.contains(&successor.n))
        .then(|| successor.clone())
}

pub(super) fn record_is_incumbent(record: Option<&Record>, n: u64) -> bool {
    record
        .and_then(|r| r.incumbent.as_ref())
        .is_some_and(|g| g.n == n)
}

/// The pid the journal recorded for generation `n`, if it started it.
pub(super) fn record_successor_pid(entry: Option<&InstanceEntry>, n: u64) -> Option<u32> {
    let record = entry?.attempt.as_ref()?;
    if record.successor.as_ref()?.n != n {
        return None;
    }
    u32::try_from(record.successor_pid?).ok()
}

/// Stops a generation with proof of exit and removes its cgroup.
pub(super) async fn stop_generation(
    listing: &GenerationListing,
    stop: &StopSpec,
) -> Result<StopReport, CgroupError> {
    let timeout = Duration::from_secs(u64::try_from(stop.timeout_seconds).unwrap_or(0));
    tracing::info!(cgroup = %listing.cgroup.path().display(), pids = ?listing.pids, "stopping a generation that must not serve");
    listing.cgroup.stop(stop_signal(stop.signal), timeout).await
}
