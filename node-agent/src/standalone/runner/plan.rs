//! Planning: an instance's next plan from the core's scheduler, and the
//! attempts it starts, one at a time per instance.

use super::*;

impl Runner {
    /// Plans `key` until the plan is quiet, starts its next attempt, and
    /// writes its state and status.
    pub(super) async fn replan(&mut self, key: &InstanceKey) {
        let Some(instance) = self.instances.get_mut(key) else {
            return;
        };
        if instance.removal != Removal::No {
            return;
        }
        let now = time_of(SystemTime::now()).0;
        for _ in 0..MAX_PLANS_PER_CHANGE {
            let node = std::slice::from_ref(&self.node);
            let first = scheduler::plan(&instance.ig, &instance.attempts, node, now);
            let (plan, _) = genswap_runtime::prometheus::measure_plan(
                first,
                self.prometheus.as_ref(),
                "standalone mode has no Prometheus to ask (--prometheus-url)",
                &instance.ig,
                &Time(now),
                |measured| scheduler::plan(measured, &instance.attempts, node, now),
            )
            .await;
            for event in &plan.events {
                if event.warning {
                    tracing::warn!(instance = %key, reason = %event.reason, "{}", event.message);
                } else {
                    tracing::info!(instance = %key, reason = %event.reason, "{}", event.message);
                }
            }
            for write in &plan.records {
                write.write_onto(&mut instance.attempts);
            }
            instance.ig.status = Some(plan.status);
            let running = instance.running.as_ref().map(|r| r.sched_rev);
            let (kept, deleted): (Vec<SwapAttempt>, Vec<SwapAttempt>) =
                std::mem::take(&mut instance.attempts)
                    .into_iter()
                    .partition(|attempt| {
                        Some(attempt.spec.sched_rev) == running
                            || !plan
                                .delete
                                .iter()
                                .any(|name| attempt.metadata.name.as_deref() == Some(name.as_str()))
                    });
            instance.attempts = kept;
            // The builds its asks staged stay until the asks go (with the
            // swap that keeps them, or a newer build).
            self.engine.keep_prestaged(
                &format!("instance {key}"),
                instance
                    .attempts
                    .iter()
                    .filter(|a| {
                        a.spec.stage_only
                            && a.status.as_ref().and_then(|s| s.outcome)
                                == Some(genswap_crds::Outcome::Done)
                    })
                    .map(|a| a.spec.build.sha256.clone())
                    .collect(),
            );
            instance.history.extend(
                deleted
                    .iter()
                    .filter(|a| a.status.as_ref().is_some_and(|s| s.outcome.is_some()))
                    .map(AttemptReport::of),
            );
            let over = instance.history.len().saturating_sub(HISTORY_KEPT);
            instance.history.drain(..over);
            instance.requeue_at = plan.requeue_after.map(|after| Instant::now() + after);
            // A record written lets the next plan drop the attempts it
            // replaces, so plan once more.
            if plan.create.is_empty() && plan.records.is_empty() {
                break;
            }
            for attempt in plan.create {
                // A stage-only attempt supersedes nothing.
                if !attempt.spec.stage_only {
                    self.gate.observe(key, attempt.spec.sched_rev);
                }
                instance.attempts.push(attempt);
            }
        }
        // The revisions are reserved durably before anything runs under
        // them (fail closed): unsaved, nothing starts, and the attempts
        // this plan made are dropped (nothing knows their revisions).
        if self.save(key).await {
            self.start_next(key);
        } else if let Some(instance) = self.instances.get_mut(key) {
            let saved: Vec<Option<String>> = instance
                .saved
                .iter()
                .flat_map(|state| state.attempts.iter().map(|a| a.metadata.name.clone()))
                .collect();
            instance
                .attempts
                .retain(|a| a.status.is_some() || saved.contains(&a.metadata.name));
            // Nothing ran or was shown under the revisions this plan issued,
            // so the next plan issues them again rather than skip past them.
            let kept_rev = instance.saved.as_ref().map_or(0, |s| s.status.sched_rev);
            if let Some(status) = instance.ig.status.as_mut() {
                status.sched_rev = kept_rev;
            }
            instance.requeue_at = Some(Instant::now() + STATE_RETRY);
        }
        self.write_status(key).await;
        self.stop_if_unselected(key);
    }

    /// A node outside the manifest's `nodeSelector` runs none of its
    /// instance, as in Kubernetes mode: what serves or runs is stopped, and
    /// the instance starts afresh from its file (a selector that matches
    /// again installs it).
    pub(super) fn stop_if_unselected(&mut self, key: &InstanceKey) {
        let Some(instance) = self.instances.get(key) else {
            return;
        };
        let labels = self.node.metadata.labels.as_ref();
        if scheduler::selects(&instance.ig.spec.node_selector, labels)
            || (instance.running.is_none() && self.engine.serving(key).is_none())
        {
            return;
        }
        tracing::info!(instance = %key, "this node no longer matches the nodeSelector; stopping the instance");
        self.request_removal(key, "this node no longer matches its nodeSelector");
    }

    /// Hands the instance's oldest attempt without an outcome to the engine,
    /// unless one already runs. Older ones than the newest are refused by
    /// the gate at admission (superseded) in a moment.
    pub(super) fn start_next(&mut self, key: &InstanceKey) {
        if self.shutting_down {
            return;
        }
        let Some(instance) = self.instances.get_mut(key) else {
            return;
        };
        if instance.running.is_some() || instance.removal != Removal::No {
            return;
        }
        let Some(next) = instance
            .attempts
            .iter_mut()
            .filter(|a| a.status.as_ref().and_then(|s| s.outcome).is_none())
            .min_by_key(|a| a.spec.sched_rev)
        else {
            return;
        };
        if next.spec.stage_only {
            let started = crate::prestage::staging_status(SystemTime::now(), Default::default());
            next.status = Some(started);
            let sched_rev = next.spec.sched_rev;
            instance.running = Some(InFlight {
                sched_rev,
                cancel: Cancel::new(),
            });
            tracing::info!(instance = %key, attempt = ?next.metadata.name, build = %next.spec.build.id, "staging ahead of the rollout");
            let (engine, tx, key) = (self.engine.clone(), self.tx.clone(), key.clone());
            let build = next.spec.build.clone();
            tokio::spawn(async move {
                let status =
                    crate::prestage::stage_ahead(engine.stager(), &build, None, |_| {}).await;
                let _ = tx.send(Msg::Staged {
                    key,
                    sched_rev,
                    status: Box::new(status),
                });
            });
            return;
        }
        let attempt = Attempt {
            instance: key.clone(),
            name: next.metadata.name.clone().unwrap_or_default(),
            spec: next.spec.clone(),
            restart: None,
        };
        let mut running = attempt_status::status_running(SystemTime::now());
        running.effective_mode = Some(attempt.effective_mode());
        next.status = Some(running);
        let sched_rev = attempt.spec.sched_rev;
        let cancel = Cancel::new();
        instance.running = Some(InFlight {
            sched_rev,
            cancel: cancel.clone(),
        });
        tracing::info!(instance = %key, attempt = %attempt.name, cause = ?attempt.spec.cause, build = %attempt.spec.build.id, "running attempt");
        let engine = self.engine.clone();
        let gate = self.gate.clone();
        let tx = self.tx.clone();
        let key = key.clone();
        tokio::spawn(async move {
            let result = engine.swap(&attempt, gate.as_ref(), &cancel).await;
            let sidecars = engine.sidecars(&attempt.instance);
            let serving = ServingChange::installed(&attempt, &result, sidecars).map(Box::new);
            let _ = tx.send(Msg::Finished {
                key,
                sched_rev,
                result: Box::new(result),
                serving,
            });
        });
    }

    pub(super) async fn requeue_due(&mut self) {
        let now = Instant::now();
        let due: Vec<InstanceKey> = self
            .instances
            .iter()
            .filter(|(_, i)| i.requeue_at.is_some_and(|at| at <= now))
            .map(|(key, _)| key.clone())
            .collect();
        for key in due {
            let Some(instance) = self.instances.get_mut(&key) else {
                continue;
            };
            instance.requeue_at = None;
            match instance.removal {
                Removal::Requested if instance.running.is_none() => self.begin_stop(&key),
                Removal::No => self.replan(&key).await,
                _ => {}
            }
        }
    }
}
