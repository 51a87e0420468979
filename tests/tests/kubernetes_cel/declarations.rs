//! The functions the Kubernetes API server's CEL environment declares, with
//! their call style (global or member) and argument types.
//!
//! Reflects Kubernetes v1.32: the base environment in
//! `k8s.io/apiserver/pkg/cel/environment/base.go` (which libraries, from
//! which version) and the declarations in `k8s.io/apiserver/pkg/cel/library`
//! (`lists.go`, `regex.go`, `urls.go`, `authz.go`, `quantity.go`, `ip.go`,
//! `cidr.go`, `format.go`), with the cel-go v0.22 libraries that base.go
//! enables: the standard declarations (`common/stdlib`), `ext.Strings`
//! version 2, `ext.Sets` and `cel.OptionalTypes`, and
//! `CrossTypeNumericComparisons`. Each library carries the Kubernetes
//! version that introduced it, so a check can target an older server.
//! Quantity's `mul`/`div`/`divInt` (after 1.33) and the semver and image
//! libraries (1.33) are not declared.

use super::types::{Type, list, map, object, optional};

/// One overload: `member` calls are `target.name(args)`, and the target's
/// type is the first of `params`.
#[derive(Clone, Debug)]
pub struct Overload {
    pub name: &'static str,
    pub member: bool,
    pub params: Vec<Type>,
    pub result: Type,
}

/// A group of declarations that arrived in one Kubernetes version.
#[derive(Clone, Debug)]
pub struct Library {
    pub name: &'static str,
    /// (major, minor) of the Kubernetes release that first enabled it.
    pub introduced: (u32, u32),
    pub overloads: Vec<Overload>,
}

const QUANTITY: Type = Type::Opaque("kubernetes.Quantity");
const URL: Type = Type::Opaque("kubernetes.URL");
const IP: Type = Type::Opaque("net.IP");
const CIDR: Type = Type::Opaque("net.CIDR");
const FORMAT: Type = Type::Opaque("kubernetes.NamedFormat");
const AUTHORIZER: Type = Type::Opaque("kubernetes.authorization.Authorizer");
const PATH_CHECK: Type = Type::Opaque("kubernetes.authorization.PathCheck");
const GROUP_CHECK: Type = Type::Opaque("kubernetes.authorization.GroupCheck");
const RESOURCE_CHECK: Type = Type::Opaque("kubernetes.authorization.ResourceCheck");
const DECISION: Type = Type::Opaque("kubernetes.authorization.Decision");
const A: Type = Type::Param("A");
const K: Type = Type::Param("K");
const V: Type = Type::Param("V");

fn global(name: &'static str, params: &[Type], result: Type) -> Overload {
    Overload {
        name,
        member: false,
        params: params.to_vec(),
        result,
    }
}

fn member(name: &'static str, params: &[Type], result: Type) -> Overload {
    Overload {
        name,
        member: true,
        params: params.to_vec(),
        result,
    }
}

/// The same overload once as a global and once as a member function, as
/// cel-go declares `size` and `matches`.
fn both(name: &'static str, params: &[Type], result: Type) -> [Overload; 2] {
    [
        global(name, params, result.clone()),
        member(name, params, result),
    ]
}

fn numbers() -> [Type; 3] {
    [Type::Int, Type::Uint, Type::Double]
}

fn standard() -> Vec<Overload> {
    use Type::{Bool, Bytes, Double, Duration, Int, String, Timestamp, Uint};
    let mut o = vec![
        global("!_", &[Bool], Bool),
        global("-_", &[Int], Int),
        global("-_", &[Double], Double),
        global("_&&_", &[Bool, Bool], Bool),
        global("_||_", &[Bool, Bool], Bool),
        global("_?_:_", &[Bool, A, A], A),
        global("_==_", &[A, A], Bool),
        global("_!=_", &[A, A], Bool),
        global("@not_strictly_false", &[Bool], Bool),
        global("@in", &[A, list(A)], Bool),
        global("@in", &[K, map(K, V)], Bool),
        global("_[_]", &[list(A), Int], A),
        global("_[_]", &[map(K, V), K], V),
        global("_+_", &[String, String], String),
        global("_+_", &[Bytes, Bytes], Bytes),
        global("_+_", &[list(A), list(A)], list(A)),
        global("_+_", &[Timestamp, Duration], Timestamp),
        global("_+_", &[Duration, Timestamp], Timestamp),
        global("_+_", &[Duration, Duration], Duration),
        global("_-_", &[Timestamp, Timestamp], Duration),
        global("_-_", &[Timestamp, Duration], Timestamp),
        global("_-_", &[Duration, Duration], Duration),
        global("_%_", &[Int, Int], Int),
        global("_%_", &[Uint, Uint], Uint),
        member("contains", &[String, String], Bool),
        member("startsWith", &[String, String], Bool),
        member("endsWith", &[String, String], Bool),
        global("dyn", &[A], Type::Dyn),
        global("type", &[A], Type::Kind),
    ];
    for number in numbers() {
        for op in ["_+_", "_-_", "_*_", "_/_"] {
            o.push(global(
                op,
                &[number.clone(), number.clone()],
                number.clone(),
            ));
        }
    }
    // Ordering within a type, and across numeric types
    // (CrossTypeNumericComparisons, on since 1.28).
    let ordered = [Bool, Int, Uint, Double, String, Bytes, Timestamp, Duration];
    for op in ["_<_", "_<=_", "_>_", "_>=_"] {
        for ty in &ordered {
            o.push(global(op, &[ty.clone(), ty.clone()], Bool));
        }
        for left in numbers() {
            for right in numbers() {
                if left != right {
                    o.push(global(op, &[left.clone(), right], Bool));
                }
            }
        }
    }
    for ty in [String, Bytes, list(A), map(K, V)] {
        o.extend(both("size", &[ty], Int));
    }
    o.extend(both("matches", &[String, String], Bool));
    for from in [Int, Uint, Double, String, Timestamp] {
        o.push(global("int", &[from], Int));
    }
    for from in [Int, Uint, Double, String] {
        o.push(global("uint", std::slice::from_ref(&from), Uint));
        o.push(global("double", &[from], Double));
    }
    for from in [Int, Uint, Double, String, Bool, Bytes, Timestamp, Duration] {
        o.push(global("string", &[from], String));
    }
    o.push(global("bytes", &[String], Bytes));
    o.push(global("bytes", &[Bytes], Bytes));
    o.push(global("bool", &[Bool], Bool));
    o.push(global("bool", &[String], Bool));
    o.push(global("duration", &[String], Duration));
    o.push(global("duration", &[Duration], Duration));
    o.push(global("timestamp", &[String], Timestamp));
    o.push(global("timestamp", &[Int], Timestamp));
    o.push(global("timestamp", &[Timestamp], Timestamp));
    for getter in [
        "getFullYear",
        "getMonth",
        "getDayOfYear",
        "getDayOfMonth",
        "getDate",
        "getDayOfWeek",
        "getHours",
        "getMinutes",
        "getSeconds",
        "getMilliseconds",
    ] {
        o.push(member(getter, &[Timestamp], Int));
        o.push(member(getter, &[Timestamp, String], Int));
    }
    for getter in ["getHours", "getMinutes", "getSeconds", "getMilliseconds"] {
        o.push(member(getter, &[Duration], Int));
    }
    o
}

fn optional_types() -> Vec<Overload> {
    vec![
        global("optional.of", &[A], optional(A)),
        global("optional.ofNonZeroValue", &[A], optional(A)),
        global("optional.none", &[], optional(Type::Dyn)),
        member("value", &[optional(A)], A),
        member("hasValue", &[optional(A)], Type::Bool),
        member("or", &[optional(A), optional(A)], optional(A)),
        member("orValue", &[optional(A), A], A),
        global("_?._", &[map(Type::String, V), Type::String], optional(V)),
        global("_[?_]", &[list(A), Type::Int], optional(A)),
        global("_[?_]", &[map(K, V), K], optional(V)),
    ]
}

fn ext_strings_v2() -> Vec<Overload> {
    use Type::{Int, String};
    vec![
        member("charAt", &[String, Int], String),
        member("indexOf", &[String, String], Int),
        member("indexOf", &[String, String, Int], Int),
        member("lastIndexOf", &[String, String], Int),
        member("lastIndexOf", &[String, String, Int], Int),
        member("lowerAscii", &[String], String),
        member("upperAscii", &[String], String),
        member("replace", &[String, String, String], String),
        member("replace", &[String, String, String, Int], String),
        member("split", &[String, String], list(String)),
        member("split", &[String, String, Int], list(String)),
        member("substring", &[String, Int], String),
        member("substring", &[String, Int, Int], String),
        member("trim", &[String], String),
        member("format", &[String, list(Type::Dyn)], String),
        global("strings.quote", &[String], String),
        member("join", &[list(String)], String),
        member("join", &[list(String), String], String),
    ]
}

fn ext_sets() -> Vec<Overload> {
    ["sets.contains", "sets.equivalent", "sets.intersects"]
        .into_iter()
        .map(|name| global(name, &[list(A), list(A)], Type::Bool))
        .collect()
}

fn lists() -> Vec<Overload> {
    use Type::{Bool, Bytes, Double, Duration, Int, String, Timestamp, Uint};
    let mut o = Vec::new();
    for ty in [Int, Uint, Double, Bool, Duration, Timestamp, String, Bytes] {
        o.push(member("isSorted", &[list(ty.clone())], Bool));
        o.push(member("max", &[list(ty.clone())], ty.clone()));
        o.push(member("min", &[list(ty.clone())], ty));
    }
    for ty in [Int, Uint, Double, Duration] {
        o.push(member("sum", &[list(ty.clone())], ty));
    }
    o.push(member("indexOf", &[list(A), A], Int));
    o.push(member("lastIndexOf", &[list(A), A], Int));
    o
}

fn regex() -> Vec<Overload> {
    use Type::{Int, String};
    vec![
        member("find", &[String, String], String),
        member("findAll", &[String, String], list(String)),
        member("findAll", &[String, String, Int], list(String)),
    ]
}

fn urls() -> Vec<Overload> {
    use Type::{Bool, String};
    let mut o = vec![
        global("url", &[String], URL),
        global("isURL", &[String], Bool),
        member("getQuery", &[URL], map(String, list(String))),
    ];
    for getter in [
        "getScheme",
        "getHost",
        "getHostname",
        "getPort",
        "getEscapedPath",
    ] {
        o.push(member(getter, &[URL], String));
    }
    o
}

fn authz() -> Vec<Overload> {
    use Type::{Bool, String};
    vec![
        member("path", &[AUTHORIZER, String], PATH_CHECK),
        member("group", &[AUTHORIZER, String], GROUP_CHECK),
        member("serviceAccount", &[AUTHORIZER, String, String], AUTHORIZER),
        member("resource", &[GROUP_CHECK, String], RESOURCE_CHECK),
        member("subresource", &[RESOURCE_CHECK, String], RESOURCE_CHECK),
        member("namespace", &[RESOURCE_CHECK, String], RESOURCE_CHECK),
        member("name", &[RESOURCE_CHECK, String], RESOURCE_CHECK),
        member("check", &[PATH_CHECK, String], DECISION),
        member("check", &[RESOURCE_CHECK, String], DECISION),
        member("errored", &[DECISION], Bool),
        member("error", &[DECISION], String),
        member("allowed", &[DECISION], Bool),
        member("reason", &[DECISION], String),
    ]
}

fn quantity() -> Vec<Overload> {
    use Type::{Bool, Double, Int, String};
    vec![
        global("quantity", &[String], QUANTITY),
        global("isQuantity", &[String], Bool),
        global("sign", &[QUANTITY], Int),
        member("isGreaterThan", &[QUANTITY, QUANTITY], Bool),
        member("isLessThan", &[QUANTITY, QUANTITY], Bool),
        member("compareTo", &[QUANTITY, QUANTITY], Int),
        member("asApproximateFloat", &[QUANTITY], Double),
        member("asInteger", &[QUANTITY], Int),
        member("isInteger", &[QUANTITY], Bool),
        member("add", &[QUANTITY, QUANTITY], QUANTITY),
        member("add", &[QUANTITY, Int], QUANTITY),
        member("sub", &[QUANTITY, QUANTITY], QUANTITY),
        member("sub", &[QUANTITY, Int], QUANTITY),
    ]
}

fn ip_and_cidr() -> Vec<Overload> {
    use Type::{Bool, Int, String};
    let mut o = vec![
        global("ip", &[String], IP),
        global("isIP", &[String], Bool),
        global("ip.isCanonical", &[String], Bool),
        member("family", &[IP], Int),
        global("string", &[IP], String),
        global("cidr", &[String], CIDR),
        global("isCIDR", &[String], Bool),
        member("containsIP", &[CIDR, String], Bool),
        member("containsIP", &[CIDR, IP], Bool),
        member("containsCIDR", &[CIDR, String], Bool),
        member("containsCIDR", &[CIDR, CIDR], Bool),
        member("ip", &[CIDR], IP),
        member("masked", &[CIDR], CIDR),
        member("prefixLength", &[CIDR], Int),
        global("string", &[CIDR], String),
    ];
    for test in [
        "isUnspecified",
        "isLoopback",
        "isLinkLocalMulticast",
        "isLinkLocalUnicast",
        "isGlobalUnicast",
    ] {
        o.push(member(test, &[IP], Bool));
    }
    o
}

fn format() -> Vec<Overload> {
    let mut o = vec![
        global("format.named", &[Type::String], optional(FORMAT)),
        member(
            "validate",
            &[FORMAT, Type::String],
            optional(list(Type::String)),
        ),
    ];
    for name in [
        "format.dns1123Label",
        "format.dns1123Subdomain",
        "format.dns1035Label",
        "format.qualifiedName",
        "format.dns1123LabelPrefix",
        "format.dns1123SubdomainPrefix",
        "format.dns1035LabelPrefix",
        "format.labelValue",
        "format.uri",
        "format.uuid",
        "format.byte",
        "format.date",
        "format.datetime",
    ] {
        o.push(global(name, &[], FORMAT));
    }
    o
}

/// Every library of the Kubernetes v1.32 base environment.
pub fn libraries() -> Vec<Library> {
    let library = |name, introduced, overloads| Library {
        name,
        introduced,
        overloads,
    };
    vec![
        library("cel-go standard", (1, 0), standard()),
        library("kubernetes.urls", (1, 0), urls()),
        library("kubernetes.regex", (1, 0), regex()),
        library("kubernetes.lists", (1, 0), lists()),
        library("kubernetes.authz", (1, 27), authz()),
        library("cel.OptionalTypes", (1, 28), optional_types()),
        library("kubernetes.quantity", (1, 28), quantity()),
        library("cel-go ext.Strings v2", (1, 29), ext_strings_v2()),
        library("cel-go ext.Sets", (1, 29), ext_sets()),
        library(
            "kubernetes.net.ip, kubernetes.net.cidr",
            (1, 30),
            ip_and_cidr(),
        ),
        library("kubernetes.format", (1, 31), format()),
    ]
}

/// The fields of an admission request as a ValidatingAdmissionPolicy sees
/// `request` (k8s.io/apiserver/pkg/admission/plugin/cel/compile.go,
/// `BuildRequestType`).
pub fn admission_request() -> Type {
    use Type::{Bool, String};
    let gvk = object(
        "request.kind",
        &[("group", String), ("version", String), ("kind", String)],
    );
    let gvr = object(
        "request.resource",
        &[("group", String), ("version", String), ("resource", String)],
    );
    let user = object(
        "request.userInfo",
        &[
            ("username", String),
            ("uid", String),
            ("groups", list(String)),
            ("extra", map(String, list(String))),
        ],
    );
    object(
        "request",
        &[
            ("kind", gvk.clone()),
            ("resource", gvr.clone()),
            ("subResource", String),
            ("requestKind", gvk),
            ("requestResource", gvr),
            ("requestSubResource", String),
            ("name", String),
            ("namespace", String),
            ("operation", String),
            ("userInfo", user),
            ("dryRun", Bool),
            ("options", Type::Dyn),
        ],
    )
}

/// `object.metadata` in an admission policy: the whole ObjectMeta.
pub fn object_meta() -> Type {
    use Type::{Int, String, Timestamp};
    object(
        "metadata",
        &[
            ("name", String),
            ("generateName", String),
            ("namespace", String),
            ("uid", String),
            ("resourceVersion", String),
            ("generation", Int),
            ("creationTimestamp", Timestamp),
            ("deletionTimestamp", Timestamp),
            ("deletionGracePeriodSeconds", Int),
            ("labels", map(String, String)),
            ("annotations", map(String, String)),
            ("ownerReferences", list(Type::Dyn)),
            ("finalizers", list(String)),
            ("managedFields", list(Type::Dyn)),
        ],
    )
}

/// The `authorizer` variable's type.
pub fn authorizer() -> Type {
    AUTHORIZER
}

/// The `authorizer.requestResource` value's type.
pub fn resource_check() -> Type {
    RESOURCE_CHECK
}
