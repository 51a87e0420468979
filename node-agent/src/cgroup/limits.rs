//! The tier limits (`memory.max`, `cpu.max`, `pids.max`): what a generation or
//! an instance asks for, how it is written, and the parent raise for an
//! overlap with its restore.

use std::fmt;
use std::path::{Path, PathBuf};

use genswap_crds::ResourcesSpec;
use serde::{Deserialize, Serialize};

use super::quantity::{QuantityError, parse_cpu_quantity, parse_memory_quantity};
use super::{CgroupError, fs_util};

/// The period written to `cpu.max`, in microseconds (the kernel default).
pub const CPU_PERIOD_US: u64 = 100_000;

/// The smallest quota the kernel accepts in `cpu.max`, in microseconds;
/// smaller requests are raised to it (as the kubelet does).
pub const CPU_MIN_QUOTA_US: u64 = 1_000;

/// A cgroup v2 controller the agent writes limits for.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Controller {
    /// `memory.max`
    Memory,
    /// `cpu.max`
    Cpu,
    /// `pids.max`
    Pids,
}

impl Controller {
    /// Every controller, in the order limits are written.
    pub const ALL: [Controller; 3] = [Controller::Memory, Controller::Cpu, Controller::Pids];

    /// The name in `cgroup.controllers` / `cgroup.subtree_control`.
    pub fn name(self) -> &'static str {
        match self {
            Controller::Memory => "memory",
            Controller::Cpu => "cpu",
            Controller::Pids => "pids",
        }
    }

    /// The interface file that carries this controller's limit.
    pub fn max_file(self) -> &'static str {
        match self {
            Controller::Memory => "memory.max",
            Controller::Cpu => "cpu.max",
            Controller::Pids => "pids.max",
        }
    }
}

impl fmt::Display for Controller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The limits of one cgroup tier. `None` means "not requested": unlimited
/// (`max`), and nothing is written for it in a generation cgroup.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Tier {
    /// `memory.max` in bytes.
    pub memory_max_bytes: Option<u64>,
    /// `cpu.max` in millicores (`500` = half a core = `"50000 100000"`).
    pub cpu_max_millicores: Option<u64>,
    /// `pids.max`.
    pub pids_max: Option<u64>,
}

impl Tier {
    /// The tier an InstanceGeneration's `resources` ask for.
    pub fn from_resources(resources: &ResourcesSpec) -> Result<Tier, QuantityError> {
        Ok(Tier {
            memory_max_bytes: resources
                .memory_max
                .as_ref()
                .map(|q| parse_memory_quantity(&q.0))
                .transpose()?,
            cpu_max_millicores: resources
                .cpu_max
                .as_ref()
                .map(|q| parse_cpu_quantity(&q.0))
                .transpose()?,
            pids_max: resources
                .pids_max
                .map(|n| {
                    u64::try_from(n)
                        .ok()
                        .filter(|&n| n > 0)
                        .ok_or_else(|| QuantityError {
                            input: n.to_string(),
                            reason: "pidsMax must be at least 1",
                        })
                })
                .transpose()?,
        })
    }

    /// The requested value for one controller, in the tier's own unit.
    pub fn get(&self, controller: Controller) -> Option<u64> {
        match controller {
            Controller::Memory => self.memory_max_bytes,
            Controller::Cpu => self.cpu_max_millicores,
            Controller::Pids => self.pids_max,
        }
    }

    /// The controllers this tier asks a limit of.
    pub fn requested(&self) -> impl Iterator<Item = Controller> + '_ {
        Controller::ALL
            .into_iter()
            .filter(|c| self.get(*c).is_some())
    }

    /// True when nothing is requested.
    pub fn is_unlimited(&self) -> bool {
        self.requested().next().is_none()
    }

    /// The text written to the controller's interface file (`max` when not
    /// requested).
    pub fn render(&self, controller: Controller) -> String {
        render(controller, self.get(controller))
    }
}

fn render(controller: Controller, value: Option<u64>) -> String {
    match (controller, value) {
        (Controller::Cpu, None) => format!("max {CPU_PERIOD_US}"),
        (Controller::Cpu, Some(millicores)) => {
            format!("{} {CPU_PERIOD_US}", cpu_quota_us(millicores))
        }
        (_, None) => "max".to_owned(),
        (_, Some(n)) => n.to_string(),
    }
}

fn cpu_quota_us(millicores: u64) -> u64 {
    millicores
        .saturating_mul(CPU_PERIOD_US / 1000)
        .max(CPU_MIN_QUOTA_US)
}

/// A current limit as read from an interface file, normalised so values
/// of one controller compare: `None` is `max`; memory in bytes, pids as a
/// count, cpu as a quota per [`CPU_PERIOD_US`].
fn parse_current(
    controller: Controller,
    path: &Path,
    text: &str,
) -> Result<Option<u64>, CgroupError> {
    let malformed = || CgroupError::Malformed {
        path: path.to_owned(),
        value: text.to_owned(),
    };
    match controller {
        Controller::Cpu => {
            let mut fields = text.split_whitespace();
            let quota = fields.next().ok_or_else(malformed)?;
            let period: u64 = match fields.next() {
                Some(p) => p.parse().map_err(|_| malformed())?,
                None => CPU_PERIOD_US,
            };
            if quota == "max" {
                return Ok(None);
            }
            let quota: u128 = quota.parse().map_err(|_| malformed())?;
            if period == 0 {
                return Err(malformed());
            }
            let normalised = quota * u128::from(CPU_PERIOD_US) / u128::from(period);
            Ok(Some(u64::try_from(normalised).unwrap_or(u64::MAX)))
        }
        _ if text == "max" => Ok(None),
        _ => text.parse().map(Some).map_err(|_| malformed()),
    }
}

/// The target value (in file units, `None` = `max`) an overlap needs for
/// one controller, or `None` when the current value already fits.
fn raise_target(
    controller: Controller,
    current: Option<u64>,
    incumbent: Option<u64>,
    successor: Option<u64>,
) -> Option<Option<u64>> {
    // Already unlimited: it stays "max".
    let current = current?;
    let in_file_units = |v: u64| match controller {
        Controller::Cpu => cpu_quota_us(v),
        _ => v,
    };
    let needed = match (incumbent, successor) {
        // Neither generation asks for this limit: whatever the parent has
        // was set by someone else and is left alone.
        (None, None) => return None,
        (Some(a), Some(b)) => Some(in_file_units(a).saturating_add(in_file_units(b))),
        // One of them runs unlimited, so together they do.
        _ => None,
    };
    match needed {
        None => Some(None),
        Some(n) if n > current => Some(Some(n)),
        Some(_) => None,
    }
}

fn render_file_units(controller: Controller, value: Option<u64>) -> String {
    match (controller, value) {
        (Controller::Cpu, None) => format!("max {CPU_PERIOD_US}"),
        (Controller::Cpu, Some(quota)) => format!("{quota} {CPU_PERIOD_US}"),
        (_, None) => "max".to_owned(),
        (_, Some(n)) => n.to_string(),
    }
}

/// One limit a raise changes: where, what it was, what it is raised to.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SavedLimit {
    /// The controller.
    pub controller: Controller,
    /// The value read before the raise, written back verbatim on restore.
    pub previous: String,
    /// The value the raise writes.
    pub raised_to: String,
}

/// What a parent raise changes, serialisable so the intent journal can
/// persist it before the first write and a restarted agent can restore it
/// ([`RaiseRecord::restore`] or [`ParentRaise::from_record`]).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RaiseRecord {
    /// The instance cgroup directory whose limits are raised.
    pub instance: PathBuf,
    /// Every limit the raise writes, with its previous value. Empty when the
    /// current limits already fit both generations.
    pub saved: Vec<SavedLimit>,
}

impl RaiseRecord {
    /// Writes every saved previous value back. Tries all of them even when
    /// one fails and returns the first failure.
    pub fn restore(&self) -> Result<(), CgroupError> {
        let mut first_error = None;
        for saved in &self.saved {
            let path = self.instance.join(saved.controller.max_file());
            if let Err(error) = fs_util::write_value(&path, &saved.previous, "restore limit in") {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RaiseState {
    /// Values read, nothing written.
    Prepared,
    /// A write may have happened: a restore is owed.
    MaybeChanged,
    /// Restored, or handed over with [`ParentRaise::disarm`].
    Done,
}

/// A raise of an instance cgroup's limits to fit incumbent plus successor
/// during an overlap, and the promise to put them back.
///
/// Two steps so nothing is written before the record exists:
/// [`InstanceCgroup::begin_raise`](super::InstanceCgroup::begin_raise) reads
/// the current values and computes the targets (no write; persist
/// [`record`](Self::record) in the journal now), then [`apply`](Self::apply)
/// marks the parent changed *before* its first write and writes. Whatever
/// happens next, call [`restore`](Self::restore) once the extra generation
/// has left (a raise that wrote `memory.max` and then failed on `pids.max`
/// restores `memory.max`). Restoring lowers limits, so do it only after
/// the retiring (or failed) generation is proven stopped, or the kernel
/// reclaims and may OOM-kill inside the instance.
///
/// If a `ParentRaise` that still owes a restore is dropped, the drop
/// restores as a last resort and logs the outcome; call `restore` yourself
/// to see errors, or [`disarm`](Self::disarm) to hand the duty to someone
/// else (the crash-recovery sweep, through the journal).
#[derive(Debug)]
pub struct ParentRaise {
    record: RaiseRecord,
    state: RaiseState,
}

impl ParentRaise {
    pub(super) fn prepare(
        instance: &Path,
        incumbent: &Tier,
        successor: &Tier,
    ) -> Result<ParentRaise, CgroupError> {
        let mut saved = Vec::new();
        for controller in Controller::ALL {
            let path = instance.join(controller.max_file());
            // A limit the parent does not have (controller not enabled)
            // cannot need raising.
            let Some(previous) = fs_util::read_optional(&path, "read limit")? else {
                continue;
            };
            let current = parse_current(controller, &path, &previous)?;
            if let Some(target) = raise_target(
                controller,
                current,
                incumbent.get(controller),
                successor.get(controller),
            ) {
                saved.push(SavedLimit {
                    controller,
                    previous,
                    raised_to: render_file_units(controller, target),
                });
            }
        }
        Ok(ParentRaise {
            record: RaiseRecord {
                instance: instance.to_owned(),
                saved,
            },
            state: RaiseState::Prepared,
        })
    }

    /// A raise rebuilt from a journal record after a restart: it owes a
    /// restore.
    pub fn from_record(record: RaiseRecord) -> ParentRaise {
        ParentRaise {
            record,
            state: RaiseState::MaybeChanged,
        }
    }

    /// What is (or will be) changed and the values to restore.
    pub fn record(&self) -> &RaiseRecord {
        &self.record
    }

    /// True when the current limits already fit and nothing will be written.
    pub fn is_noop(&self) -> bool {
        self.record.saved.is_empty()
    }

    /// True while a write may have happened and no restore succeeded yet.
    pub fn needs_restore(&self) -> bool {
        self.state == RaiseState::MaybeChanged
    }

    /// Writes the raised values (memory, cpu, pids in that order). The
    /// parent counts as changed from before the first write, so on an
    /// error [`restore`](Self::restore) puts back what was written.
    pub fn apply(&mut self) -> Result<(), CgroupError> {
        if self.record.saved.is_empty() {
            return Ok(());
        }
        self.state = RaiseState::MaybeChanged;
        for saved in &self.record.saved {
            let path = self.record.instance.join(saved.controller.max_file());
            fs_util::write_value(&path, &saved.raised_to, "raise limit in")?;
        }
        Ok(())
    }

    /// Puts the previous values back. Nothing is written when `apply` never
    /// ran. On an error the raise still owes a restore and this may be
    /// called again.
    pub fn restore(&mut self) -> Result<(), CgroupError> {
        if self.state == RaiseState::MaybeChanged {
            self.record.restore()?;
        }
        self.state = RaiseState::Done;
        Ok(())
    }

    /// Gives up the duty to restore, returning the record to whoever takes
    /// it over. The drop will not restore.
    pub fn disarm(mut self) -> RaiseRecord {
        self.state = RaiseState::Done;
        self.record.clone()
    }
}

impl Drop for ParentRaise {
    fn drop(&mut self) {
        if self.state != RaiseState::MaybeChanged {
            return;
        }
        match self.record.restore() {
            Ok(()) => tracing::warn!(
                instance = %self.record.instance.display(),
                "a raised parent cgroup was dropped without restore; restored it"
            ),
            Err(error) => tracing::error!(
                instance = %self.record.instance.display(),
                %error,
                "a raised parent cgroup was dropped without restore and could not be restored"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendering() {
        let tier = Tier {
            memory_max_bytes: Some(536_870_912),
            cpu_max_millicores: Some(500),
            pids_max: Some(64),
        };
        assert_eq!(tier.render(Controller::Memory), "536870912");
        assert_eq!(tier.render(Controller::Cpu), "50000 100000");
        assert_eq!(tier.render(Controller::Pids), "64");
        let unlimited = Tier::default();
        assert_eq!(unlimited.render(Controller::Cpu), "max 100000");
        assert_eq!(unlimited.render(Controller::Memory), "max");
        let tiny = Tier {
            cpu_max_millicores: Some(1),
            ..Tier::default()
        };
        assert_eq!(tiny.render(Controller::Cpu), "1000 100000");
    }

    #[test]
    fn raise_targets() {
        use Controller::*;
        // sums
        assert_eq!(
            raise_target(Memory, Some(100), Some(100), Some(50)),
            Some(Some(150))
        );
        assert_eq!(
            raise_target(Cpu, Some(50_000), Some(500), Some(1000)),
            Some(Some(150_000))
        );
        // "max" stays "max"
        assert_eq!(raise_target(Memory, None, Some(100), Some(50)), None);
        // one side unlimited: max
        assert_eq!(raise_target(Pids, Some(10), None, Some(5)), Some(None));
        // nobody asks: untouched
        assert_eq!(raise_target(Pids, Some(10), None, None), None);
        // already fits: untouched
        assert_eq!(raise_target(Memory, Some(1000), Some(100), Some(50)), None);
    }

    #[test]
    fn current_values_parse() {
        let p = Path::new("x");
        assert_eq!(
            parse_current(Controller::Cpu, p, "max 100000").ok(),
            Some(None)
        );
        assert_eq!(
            parse_current(Controller::Cpu, p, "5000 10000").ok(),
            Some(Some(50_000))
        );
        assert_eq!(parse_current(Controller::Memory, p, "max").ok(), Some(None));
        assert_eq!(
            parse_current(Controller::Pids, p, "12").ok(),
            Some(Some(12))
        );
        assert!(parse_current(Controller::Pids, p, "lots").is_err());
        assert!(parse_current(Controller::Cpu, p, "1 0").is_err());
    }

    #[test]
    fn tier_from_resources() {
        let q = |text: &str| k8s_quantity_string(text);
        let resources = ResourcesSpec {
            memory_max: Some(q("512Mi")),
            cpu_max: Some(q("500m")),
            pids_max: Some(100),
        };
        assert_eq!(
            Tier::from_resources(&resources),
            Ok(Tier {
                memory_max_bytes: Some(512 << 20),
                cpu_max_millicores: Some(500),
                pids_max: Some(100),
            })
        );
        let bad = ResourcesSpec {
            memory_max: Some(q("lots")),
            ..ResourcesSpec::default()
        };
        assert!(Tier::from_resources(&bad).is_err());
        let zero_pids = ResourcesSpec {
            pids_max: Some(0),
            ..ResourcesSpec::default()
        };
        assert!(Tier::from_resources(&zero_pids).is_err());
    }

    /// The API's Quantity is a newtype over String; build one through serde
    /// so this crate need not name k8s-openapi.
    fn k8s_quantity_string<T: serde::de::DeserializeOwned>(text: &str) -> T {
        serde_json::from_value(serde_json::Value::String(text.to_owned())).expect("a quantity")
    }
}
