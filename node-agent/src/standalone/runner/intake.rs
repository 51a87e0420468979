//! Intake: the state saved by the last run and the manifests in the
//! directory, read into the runner's instances.

use super::*;

impl Runner {
    /// Loads every instance's state and the journal's unacknowledged
    /// outcomes.
    pub(super) async fn load_state(&mut self) -> Result<(), StandaloneError> {
        let store = self.store.clone();
        let (states, broken) = blocking(move || store.load_all()).await?;
        for error in broken {
            tracing::error!(%error, "a standalone state file cannot be read; its instance starts afresh when its manifest is seen");
        }
        let journal_engine = self.engine.clone();
        if let Err(error) = blocking(move || journal_engine.journal().remove_temp_files()).await {
            tracing::warn!(%error, "leftover journal temp files could not be removed");
        }
        for state in states {
            let key = state.instance.clone();
            let mut instance = Instance {
                file: state.file.clone(),
                ig: object(&key, state.generation, state.spec.clone(), None, None),
                attempts: state.attempts.clone(),
                history: state.history.clone(),
                running: None,
                requeue_at: None,
                invalid: None,
                removal: Removal::No,
                saved: Some(state.clone()),
                unkept: None,
            };
            instance.ig.status = Some(state.status.clone());
            if let Some(newest) = instance.attempts.iter().map(|a| a.spec.sched_rev).max() {
                self.gate.observe(&key, newest);
            }
            self.instances.insert(key, instance);
        }
        let engine = self.engine.clone();
        let pending = match blocking(move || engine.journal().pending_reports()).await {
            Ok(pending) => pending,
            Err(error) => {
                tracing::error!(%error, "the intent journal cannot be read; outcomes it holds are not reported");
                Vec::new()
            }
        };
        for record in pending {
            let key = record.instance.clone();
            let sched_rev = record.attempt.sched_rev;
            if let (Some(instance), Some(outcome)) =
                (self.instances.get_mut(&key), record.outcome.as_ref())
                && let Some(attempt) = instance.attempts.iter_mut().find(|a| {
                    a.spec.sched_rev == sched_rev
                        && a.status.as_ref().and_then(|s| s.outcome).is_none()
                })
            {
                tracing::info!(instance = %key, sched_rev, outcome = ?outcome.outcome, "an outcome from before the restart, kept by the intent journal");
                attempt.status = Some(attempt_status::status_from_outcome_record(outcome));
            }
            self.pending_acks.push((key, sched_rev));
        }
        Ok(())
    }

    /// Reads the directory again and brings instances, refusals and status
    /// files in line with it.
    pub(super) async fn rescan(&mut self) {
        if self.shutting_down {
            return;
        }
        let dir = self.dir.clone();
        let previous = self.files.clone();
        self.files = match blocking(move || manifests::scan(&dir, &previous)).await {
            Ok(files) => files,
            Err(error) => {
                tracing::error!(dir = %self.dir.display(), %error, "the manifest directory cannot be read");
                return;
            }
        };

        // Existing instances keep their file, pass to another file that names
        // them, or go.
        let mut owners: BTreeMap<InstanceKey, String> = BTreeMap::new();
        let mut gone = Vec::new();
        for (key, instance) in &mut self.instances {
            if instance.removal == Removal::No {
                let keeps = match self.files.get(&instance.file).map(|f| &f.parsed) {
                    Some(Parsed::Valid { key: named, .. }) => named == key,
                    Some(Parsed::Invalid(_)) => true,
                    None => false,
                };
                if !keeps {
                    let heir = self
                        .files
                        .iter()
                        .find_map(|(name, file)| match &file.parsed {
                            Parsed::Valid { key: named, .. } if named == key => Some(name.clone()),
                            _ => None,
                        });
                    match heir {
                        Some(heir) => {
                            tracing::info!(instance = %key, from = %instance.file, to = %heir, "another file now defines the instance");
                            instance.file = heir;
                        }
                        None => gone.push(key.clone()),
                    }
                }
            }
            owners.insert(key.clone(), instance.file.clone());
        }

        let now = time_of(SystemTime::now());
        let mut refused: Vec<(String, StatusDocument)> = Vec::new();
        let mut touched: BTreeSet<InstanceKey> = BTreeSet::new();
        for (name, file) in &self.files {
            match &file.parsed {
                Parsed::Invalid(error) => {
                    let owned = self
                        .instances
                        .iter_mut()
                        .find(|(key, i)| i.file == *name && !gone.contains(key));
                    match owned {
                        Some((key, instance)) if instance.removal == Removal::No => {
                            if instance.invalid.as_ref().map(|(e, _)| e) != Some(error) {
                                tracing::warn!(instance = %key, file = %name, %error, "the manifest no longer validates; its last valid spec stays in force");
                                instance.invalid = Some((error.clone(), now.clone()));
                                touched.insert(key.clone());
                            }
                        }
                        _ => {
                            if self.written.get(name).and_then(|d| d.error.as_deref())
                                != Some(error.as_str())
                            {
                                tracing::warn!(file = %name, %error, "manifest refused");
                            }
                            refused.push((
                                name.clone(),
                                status::for_refused(
                                    name,
                                    None,
                                    reasons::INVALID_MANIFEST,
                                    error,
                                    &now,
                                ),
                            ));
                        }
                    }
                }
                Parsed::Valid { key, ig } => match owners.get(key) {
                    Some(owner) if owner == name && !gone.contains(key) => {
                        if let Some(instance) = self.instances.get_mut(key)
                            && instance.removal == Removal::No
                            && apply_manifest(instance, ig)
                        {
                            touched.insert(key.clone());
                        }
                    }
                    Some(owner) => {
                        let stopping = self
                            .instances
                            .get(key)
                            .is_some_and(|i| i.removal != Removal::No)
                            || gone.contains(key);
                        let message = if stopping {
                            format!(
                                "{}/{} is still defined by {owner}, which was deleted; this file takes over once its generations have stopped",
                                key.namespace(),
                                key.name()
                            )
                        } else {
                            format!(
                                "{}/{} is already defined by {owner}; this file is ignored until that file is removed or names another instance",
                                key.namespace(),
                                key.name()
                            )
                        };
                        refused.push((
                            name.clone(),
                            status::for_refused(
                                name,
                                Some(key),
                                reasons::DUPLICATE_NAME,
                                &message,
                                &now,
                            ),
                        ));
                    }
                    None => {
                        tracing::info!(instance = %key, file = %name, "new instance");
                        let instance = Instance {
                            file: name.clone(),
                            ig: object(
                                key,
                                1,
                                ig.spec.clone(),
                                ig.metadata.labels.clone(),
                                ig.metadata.annotations.clone(),
                            ),
                            attempts: Vec::new(),
                            history: Vec::new(),
                            running: None,
                            requeue_at: None,
                            invalid: None,
                            removal: Removal::No,
                            saved: None,
                            unkept: None,
                        };
                        self.instances.insert(key.clone(), instance);
                        owners.insert(key.clone(), name.clone());
                        touched.insert(key.clone());
                    }
                },
            }
        }

        for key in &gone {
            let file = self
                .instances
                .get(key)
                .map(|i| i.file.clone())
                .unwrap_or_default();
            tracing::info!(instance = %key, %file, "the manifest was deleted; stopping the instance");
            self.request_removal(key, &format!("its manifest {file} was deleted"));
        }
        for key in touched {
            self.replan(&key).await;
        }
        for (name, document) in refused {
            self.write_status_document(&name, document).await;
        }
        self.remove_stale_status_files().await;
    }
}

/// Copies a valid manifest into the instance: a changed spec is a new
/// generation. Returns whether anything the scheduler reads changed.
pub(super) fn apply_manifest(instance: &mut Instance, ig: &InstanceGeneration) -> bool {
    let was_invalid = instance.invalid.take().is_some();
    instance.ig.metadata.labels = ig.metadata.labels.clone();
    instance.ig.metadata.annotations = ig.metadata.annotations.clone();
    if instance.ig.spec == ig.spec {
        return was_invalid;
    }
    instance.ig.spec = ig.spec.clone();
    instance.ig.metadata.generation = Some(instance.generation() + 1);
    true
}

/// The InstanceGeneration the scheduler plans: the manifest's spec with the
/// generation standalone mode keeps, no uid (so attempts carry no owner
/// reference), in the instance's namespace.
pub(super) fn object(
    key: &InstanceKey,
    generation: i64,
    spec: genswap_crds::InstanceGenerationSpec,
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
) -> InstanceGeneration {
    let mut ig = InstanceGeneration::new(key.name(), spec);
    ig.metadata = ObjectMeta {
        name: Some(key.name().to_string()),
        namespace: Some(key.namespace().to_string()),
        generation: Some(generation),
        labels,
        annotations,
        ..ObjectMeta::default()
    };
    ig
}
