//! Reporting: an attempt's end folded into the instance, its state saved,
//! and the status documents beside the manifests written.

use super::*;

impl Runner {
    /// An attempt ended: its result becomes its status, the status file
    /// says so, then the journal lets go of it and the instance is planned
    /// again.
    pub(super) async fn finished(
        &mut self,
        key: InstanceKey,
        sched_rev: i64,
        result: SwapResult,
        serving: Option<Box<ServingChange>>,
    ) {
        let Some(instance) = self.instances.get_mut(&key) else {
            self.acknowledge(&key, sched_rev).await;
            return;
        };
        instance.running = None;
        tracing::info!(
            instance = %key,
            sched_rev,
            outcome = ?result.outcome,
            mode = ?result.effective_mode,
            executed = result.executed,
            drain_ms = ?result.drain_ms(),
            reason = %result.reason,
            "attempt ended"
        );
        if let Some(attempt) = instance
            .attempts
            .iter_mut()
            .find(|a| a.spec.sched_rev == sched_rev)
        {
            let mut status = attempt_status::status_from_result(&result);
            status.serving = serving.map(|change| {
                attempt_status::serving_status(&change.supervised, None, &change.sidecars)
            });
            attempt.status = Some(status);
        }
        match instance.removal {
            Removal::No => {
                self.replan(&key).await;
                if self.instances.get(&key).is_some_and(|i| i.is_saved(&key)) {
                    self.acknowledge(&key, sched_rev).await;
                } else if !self.journal_keeps(&key, sched_rev).await {
                    // Kept nowhere: a restart would not know it, so it is
                    // not shown either. The attempt stands as not run and
                    // runs again once its revision is on disk.
                    if let Some(attempt) = self.instances.get_mut(&key).and_then(|i| {
                        i.attempts
                            .iter_mut()
                            .find(|a| a.spec.sched_rev == sched_rev)
                    }) {
                        attempt.status = None;
                    }
                    self.replan(&key).await;
                }
            }
            Removal::Requested | Removal::Stopping => {
                // The instance goes away: its outcome has no reader left.
                self.acknowledge(&key, sched_rev).await;
                self.begin_stop(&key);
            }
        }
    }

    /// A stage-only attempt ended: its status is shown and the instance
    /// planned again. Nothing journals it; a restart stages it again.
    pub(super) async fn staged(
        &mut self,
        key: InstanceKey,
        sched_rev: i64,
        status: SwapAttemptStatus,
    ) {
        let Some(instance) = self.instances.get_mut(&key) else {
            return;
        };
        instance.running = None;
        if let Some(attempt) = instance
            .attempts
            .iter_mut()
            .find(|a| a.spec.sched_rev == sched_rev)
        {
            attempt.status = Some(status);
        }
        match instance.removal {
            Removal::No => self.replan(&key).await,
            Removal::Requested | Removal::Stopping => self.begin_stop(&key),
        }
    }

    /// Whether the journal holds the outcome of `sched_rev` for a restart
    /// to deliver.
    pub(super) async fn journal_keeps(&self, key: &InstanceKey, sched_rev: i64) -> bool {
        let engine = self.engine.clone();
        let owned = key.clone();
        blocking(move || engine.journal().load_entry(&owned))
            .await
            .ok()
            .flatten()
            .is_some_and(|entry| {
                entry
                    .pending_reports()
                    .iter()
                    .any(|r| r.attempt.sched_rev == sched_rev)
            })
    }

    /// Drops the journal's copy of an outcome the status file now holds.
    pub(super) async fn acknowledge(&self, key: &InstanceKey, sched_rev: i64) {
        let engine = self.engine.clone();
        let owned = key.clone();
        if let Err(error) = blocking(move || engine.journal().acknowledge(&owned, sched_rev)).await
        {
            tracing::warn!(instance = %key, sched_rev, %error, "the intent journal could not drop a reported outcome; it is reported again after a restart");
        }
    }

    /// Writes the instance's state unless it is unchanged; `true` when
    /// what is in memory is on disk.
    pub(super) async fn save(&mut self, key: &InstanceKey) -> bool {
        let Some(instance) = self.instances.get_mut(key) else {
            return false;
        };
        let state = instance.state(key);
        if instance.saved.as_ref() == Some(&state) {
            return true;
        }
        let store = self.store.clone();
        let to_write = state.clone();
        match blocking(move || store.save(&to_write)).await {
            Ok(()) => {
                instance.saved = Some(state);
                instance.unkept = None;
                true
            }
            Err(error) => {
                tracing::error!(instance = %key, %error, "the standalone state could not be written; nothing starts until it can");
                if instance.unkept.is_none() {
                    instance.unkept = Some((
                        format!(
                            "the standalone state cannot be written ({error}); no attempt starts until it can"
                        ),
                        time_of(SystemTime::now()),
                    ));
                }
                false
            }
        }
    }

    pub(super) async fn write_status(&mut self, key: &InstanceKey) {
        let Some(instance) = self.instances.get(key) else {
            return;
        };
        let document = status::for_instance(
            &instance.file,
            key,
            instance.generation(),
            &instance.ig.status.clone().unwrap_or_default(),
            &instance.attempts,
            &instance.history,
            instance
                .invalid
                .as_ref()
                .map(|(error, since)| (error.as_str(), since)),
        );
        let mut document = document;
        if let Some((error, since)) = &instance.unkept {
            set_condition(
                &mut document.status.conditions,
                ConditionType::Stalled,
                true,
                STATE_UNWRITABLE,
                error,
                Some(instance.generation()),
                since,
            );
            document.error.get_or_insert_with(|| error.clone());
        }
        let file = instance.file.clone();
        self.write_status_document(&file, document).await;
    }

    pub(super) async fn write_status_document(&mut self, file: &str, document: StatusDocument) {
        if self.written.get(file) == Some(&document) {
            return;
        }
        // A refusal that still holds keeps the status (and the time) it has.
        if document.generation.is_none()
            && self.written.get(file).is_some_and(|written| {
                written.generation.is_none()
                    && written.error == document.error
                    && (&written.namespace, &written.name) == (&document.namespace, &document.name)
            })
        {
            return;
        }
        let text = match status::render(&document) {
            Ok(text) => text,
            Err(error) => {
                tracing::error!(%file, %error, "a status file could not be encoded");
                return;
            }
        };
        let path = self.status_dir.join(file);
        match blocking(move || replace_file(&path, text.as_bytes(), 0o644)).await {
            Ok(()) => {
                self.written.insert(file.to_string(), document);
            }
            Err(error) => tracing::error!(%file, %error, "a status file could not be written"),
        }
    }

    pub(super) async fn remove_status_file(&mut self, file: &str) {
        self.written.remove(file);
        let path = self.status_dir.join(file);
        if let Err(error) = blocking(move || remove_if_exists(&path)).await {
            tracing::warn!(%file, %error, "a status file could not be removed");
        }
    }

    /// Removes status files whose manifest is gone (deleted while standalone
    /// mode was not running, or a refused file deleted), keeping those of
    /// instances still being stopped.
    pub(super) async fn remove_stale_status_files(&mut self) {
        let dir = self.status_dir.clone();
        let on_disk: Vec<String> = blocking(move || {
            fs::read_dir(&dir)
                .map(|entries| {
                    entries
                        .filter_map(Result::ok)
                        .filter_map(|e| e.file_name().to_str().map(str::to_string))
                        .filter(|name| manifests::is_manifest_name(name))
                        .collect()
                })
                .unwrap_or_default()
        })
        .await;
        let in_use: BTreeSet<&String> = self
            .files
            .keys()
            .chain(self.instances.values().map(|i| &i.file))
            .collect();
        let stale: Vec<String> = on_disk
            .into_iter()
            .chain(self.written.keys().cloned())
            .filter(|name| !in_use.contains(name))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        for name in stale {
            self.remove_status_file(&name).await;
        }
    }
}
