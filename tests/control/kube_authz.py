"""Authorization and admission as a Kubernetes apiserver does them, for the fake apiserver.

Two checks stand between a request and the store, in the apiserver's order:

- ``RbacAuthorizer``: Roles, ClusterRoles, RoleBindings and ClusterRoleBindings evaluated as the
  RBAC authorizer evaluates them (rbac/v1 ``RulesAllow``: verbs, apiGroups, resources with
  subresources and ``*/sub``, resourceNames). The group ``system:masters`` bypasses it, as the
  apiserver's superuser group does. A denial is the apiserver's 403 message, word for word.
- ``AdmissionPolicies``: ValidatingAdmissionPolicies and their bindings
  (admissionregistration.k8s.io/v1): match constraints, selectors, matchConditions, variables,
  validations, failurePolicy and validationActions. The CEL runs in cel-python (``celpy``), not in
  the apiserver's cel-go; the kit's policies keep to the CEL both accept (no optional syntax
  ``.?``/``orValue``, no ``!= null`` on objects, a guard with ``has()`` or ``in`` before every
  field or key that may be absent).

What is not modelled: ClusterRole aggregation, nonResourceURLs, impersonation, paramKind/paramRef
(``params`` is always null), matchPolicy Equivalent (requests match by their own group/version),
type checking of the CEL against the OpenAPI schemas, and CEL cost limits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import celpy
from celpy import celtypes

ADMISSION_GROUP = "admissionregistration.k8s.io"
RBAC_GROUP = "rbac.authorization.k8s.io"
SUPERUSER_GROUP = "system:masters"

# celpy logs every evaluation error it carries as a value; the decision is what matters here.
logging.getLogger("celpy").setLevel(logging.CRITICAL)


@dataclass(frozen=True)
class UserInfo:
    """Who makes a request: the authenticated username and groups, as the apiserver sees them."""

    username: str
    groups: tuple[str, ...] = ()


def service_account_user(namespace: str, name: str) -> UserInfo:
    """The user a ServiceAccount token authenticates as."""
    return UserInfo(
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"),
    )


#: The cluster creator: in system:masters, so RBAC allows it everything.
ADMIN = UserInfo("kubernetes-admin", (SUPERUSER_GROUP, "system:authenticated"))


def _qualified(api_group: str, resource: str) -> str:
    """``resource.group`` as the apiserver names a resource in messages (core: just resource)."""
    return f"{resource}.{api_group}" if api_group else resource


def forbidden_message(api_group: str, resource: str, name: str, reason: str) -> str:
    """apierrors.NewForbidden's message: ``<resource>[.<group>] ["<name>" ]is forbidden: <reason>``."""
    subject = _qualified(api_group, resource)
    if name:
        subject = f'{subject} "{name}"'
    return f"{subject} is forbidden: {reason}"


# --------------------------------------------------------------------------------------------
# RBAC
# --------------------------------------------------------------------------------------------


def _rule_allows(rule: dict[str, Any], verb: str, api_group: str, resource: str, subresource: str, name: str) -> bool:
    """One PolicyRule against one request, as rbac/v1 RuleAllows does it."""
    verbs = rule.get("verbs") or []
    if "*" not in verbs and verb not in verbs:
        return False
    groups = rule.get("apiGroups") or []
    if "*" not in groups and api_group not in groups:
        return False
    combined = f"{resource}/{subresource}" if subresource else resource
    resources = rule.get("resources") or []  # a nonResourceURLs rule has none: never matches here
    if not any(r == "*" or r == combined or (subresource and r == f"*/{subresource}") for r in resources):
        return False
    # resourceNames restricts requests that name an object; list, watch-all and create name none,
    # so a rule with resourceNames never grants them.
    names = rule.get("resourceNames") or []
    return not names or name in names


def _subject_matches(subject: dict[str, Any], user: UserInfo, binding_namespace: str) -> bool:
    kind = subject.get("kind")
    if kind == "User":
        return subject.get("name") == user.username
    if kind == "Group":
        return subject.get("name") in user.groups
    if kind == "ServiceAccount":
        # A RoleBinding's ServiceAccount subject without a namespace means the binding's own.
        namespace = subject.get("namespace") or binding_namespace
        return user.username == f"system:serviceaccount:{namespace}:{subject.get('name')}"
    return False


class RbacAuthorizer:
    """The RBAC authorizer over a set of objects (anything that is not RBAC is ignored)."""

    def __init__(self, objects: list[dict[str, Any]]):
        self.roles: dict[tuple[str, str], list[dict]] = {}  # (namespace, name) -> rules
        self.cluster_roles: dict[str, list[dict]] = {}
        self.role_bindings: list[dict[str, Any]] = []
        self.cluster_role_bindings: list[dict[str, Any]] = []
        for obj in objects:
            if not obj or obj.get("apiVersion", "").split("/")[0] != RBAC_GROUP:
                continue
            meta = obj.get("metadata") or {}
            kind = obj.get("kind")
            if kind == "Role":
                self.roles[(meta.get("namespace", "default"), meta["name"])] = obj.get("rules") or []
            elif kind == "ClusterRole":
                self.cluster_roles[meta["name"]] = obj.get("rules") or []
            elif kind == "RoleBinding":
                self.role_bindings.append(obj)
            elif kind == "ClusterRoleBinding":
                self.cluster_role_bindings.append(obj)

    def _rules_of(self, role_ref: dict[str, Any], namespace: str) -> list[dict]:
        if role_ref.get("kind") == "ClusterRole":
            return self.cluster_roles.get(role_ref.get("name", ""), [])
        return self.roles.get((namespace, role_ref.get("name", "")), [])

    def _bound_rules(self, user: UserInfo, namespace: str):
        """Every rule bound to ``user`` that applies in ``namespace`` ("" = cluster scope)."""
        for binding in self.cluster_role_bindings:
            if any(_subject_matches(s, user, "") for s in binding.get("subjects") or []):
                yield from self._rules_of(binding.get("roleRef") or {}, "")
        if not namespace:
            return  # RoleBindings never grant cluster-scoped requests
        for binding in self.role_bindings:
            bound_ns = (binding.get("metadata") or {}).get("namespace", "default")
            if bound_ns != namespace:
                continue
            if any(_subject_matches(s, user, bound_ns) for s in binding.get("subjects") or []):
                yield from self._rules_of(binding.get("roleRef") or {}, bound_ns)

    def authorize(
        self, user: UserInfo, verb: str, api_group: str, resource: str, subresource: str, namespace: str, name: str
    ) -> str | None:
        """None when the request is allowed, else the apiserver's 403 message."""
        if SUPERUSER_GROUP in user.groups:
            return None
        if any(
            _rule_allows(rule, verb, api_group, resource, subresource, name)
            for rule in self._bound_rules(user, namespace)
        ):
            return None
        requested = f"{resource}/{subresource}" if subresource else resource
        where = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        reason = f'User "{user.username}" cannot {verb} resource "{requested}" in API group "{api_group}" {where}'
        return forbidden_message(api_group, resource, name, reason)


# --------------------------------------------------------------------------------------------
# Label selectors and resource rules (admission matching)
# --------------------------------------------------------------------------------------------


def selector_matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector against labels; an absent or empty selector matches everything."""
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _listed(values: list[str] | None, value: str) -> bool:
    return bool(values) and ("*" in values or value in values)


def _resource_listed(resources: list[str] | None, resource: str, subresource: str) -> bool:
    """admissionregistration's resources: "pods" is the resource only, "pods/status" a
    subresource, "*" every resource (no subresources), "*/*" everything, "*/status", "pods/*"."""
    for entry in resources or []:
        res, _, sub = entry.partition("/")
        if res not in ("*", resource):
            continue
        if (not sub and not subresource) or sub == "*" or (sub and sub == subresource):
            return True
    return False


def _rule_matches(
    rule: dict[str, Any],
    operation: str,
    api_group: str,
    api_version: str,
    resource: str,
    subresource: str,
    namespace: str,
    name: str,
) -> bool:
    scope = rule.get("scope", "*")
    if scope == "Cluster" and namespace or scope == "Namespaced" and not namespace:
        return False
    if rule.get("resourceNames") and name not in rule["resourceNames"]:
        return False
    return (
        _listed(rule.get("operations"), operation)
        and _listed(rule.get("apiGroups"), api_group)
        and _listed(rule.get("apiVersions"), api_version)
        and _resource_listed(rule.get("resources"), resource, subresource)
    )


# --------------------------------------------------------------------------------------------
# ValidatingAdmissionPolicy
# --------------------------------------------------------------------------------------------

#: reason -> HTTP code, as the apiserver's validating policy dispatcher maps it (default Invalid).
REASON_CODES = {"Forbidden": 403, "Unauthorized": 401, "RequestEntityTooLarge": 413, "Invalid": 422}

_CEL = celpy.Environment()


class _CelError(Exception):
    """An expression that would not compile or evaluate; its message says which and why."""


def _compile(expression: str):
    try:
        return _CEL.program(_CEL.compile(expression))
    except Exception as exc:  # celpy raises its parser's errors; one message for all
        raise _CelError(f"compilation failed: {exc}") from exc


def _evaluate(program, expression: str, activation: dict[str, Any]):
    try:
        result = program.evaluate(activation)
    except Exception as exc:  # noqa: BLE001 - any failure is an evaluation error, as in cel-go
        result = exc
    if isinstance(result, Exception):
        detail = result.args[0] if isinstance(result, celpy.CELEvalError) and result.args else result
        raise _CelError(f"expression '{expression}' resulted in error: {detail}")
    return result


def _labels(obj: dict[str, Any] | None) -> dict[str, str]:
    return ((obj or {}).get("metadata") or {}).get("labels") or {}


class _LazyVariables(celtypes.MapType):
    """``variables``: each one evaluated when first read, in the order the policy declares them,
    so one that fails only fails the expressions that use it (as the apiserver does)."""

    def __init__(self, programs: dict[str, tuple[str, Any]], activation: dict[str, Any]):
        super().__init__({})
        self._programs, self._activation = programs, activation

    def _value(self, key):
        name = str(key)
        if name not in self._programs:
            raise KeyError(name)
        if celtypes.StringType(name) not in self.keys():
            expression, program = self._programs[name]
            try:
                value = _evaluate(program, expression, self._activation)
            except _CelError as exc:
                value = celpy.CELEvalError(str(exc))
            super().__setitem__(celtypes.StringType(name), value)
        return super().__getitem__(celtypes.StringType(name))

    def __getitem__(self, key):
        value = self._value(key)
        if isinstance(value, celpy.CELEvalError):
            raise value
        return value

    def __contains__(self, key):
        return str(key) in self._programs


@dataclass
class _Policy:
    name: str
    spec: dict[str, Any]
    match_conditions: list[tuple[str, str, Any]]  # (name, expression, program)
    variables: dict[str, tuple[str, Any]]
    validations: list[tuple[dict[str, Any], Any, Any]]  # (validation, program, messageExpression program)
    compile_error: str | None


def _load_policy(obj: dict[str, Any]) -> _Policy:
    spec = obj.get("spec") or {}
    name = obj["metadata"]["name"]
    try:
        conditions = [
            (c["name"], c["expression"], _compile(c["expression"])) for c in spec.get("matchConditions") or []
        ]
        variables = {v["name"]: (v["expression"], _compile(v["expression"])) for v in spec.get("variables") or []}
        validations = [
            (v, _compile(v["expression"]), _compile(v["messageExpression"]) if v.get("messageExpression") else None)
            for v in spec.get("validations") or []
        ]
        return _Policy(name, spec, conditions, variables, validations, None)
    except _CelError as exc:
        return _Policy(name, spec, [], {}, [], str(exc))


class AdmissionPolicies:
    """The validating admission policies among ``objects`` and their bindings (others ignored)."""

    def __init__(self, objects: list[dict[str, Any]]):
        self.policies: dict[str, _Policy] = {}
        self.bindings: list[dict[str, Any]] = []
        #: Warn/Audit decisions of the last admit() call: (policy, binding, message).
        self.warnings: list[tuple[str, str, str]] = []
        for obj in objects:
            if not obj or obj.get("apiVersion", "").split("/")[0] != ADMISSION_GROUP:
                continue
            if obj.get("kind") == "ValidatingAdmissionPolicy":
                self.policies[obj["metadata"]["name"]] = _load_policy(obj)
            elif obj.get("kind") == "ValidatingAdmissionPolicyBinding":
                self.bindings.append(obj)

    # -- matching -----------------------------------------------------------------------------

    @staticmethod
    def _matches(
        match: dict[str, Any] | None, request: dict[str, Any], obj, old_obj, namespace_labels: dict[str, str]
    ) -> bool:
        """matchConstraints / matchResources against a request (None: match everything)."""
        if match is None:
            return True
        # Cluster-scoped requests always pass a namespaceSelector (the apiserver's rule).
        if request["namespace"] and not selector_matches(match.get("namespaceSelector"), namespace_labels):
            return False
        selector = match.get("objectSelector")
        if selector and not (selector_matches(selector, _labels(obj)) or selector_matches(selector, _labels(old_obj))):
            return False
        args = (
            request["operation"],
            request["resource"]["group"],
            request["resource"]["version"],
            request["resource"]["resource"],
            request["subResource"],
            request["namespace"],
            request["name"],
        )
        if any(_rule_matches(rule, *args) for rule in match.get("excludeResourceRules") or []):
            return False
        rules = match.get("resourceRules") or []
        return not rules or any(_rule_matches(rule, *args) for rule in rules)

    # -- evaluation ---------------------------------------------------------------------------

    @staticmethod
    def _activation(
        policy: _Policy, user: UserInfo, request: dict[str, Any], obj, old_obj, namespace_obj
    ) -> dict[str, Any]:
        activation: dict[str, Any] = {
            "object": celpy.json_to_cel(obj),
            "oldObject": celpy.json_to_cel(old_obj),
            "request": celpy.json_to_cel(request),
            "namespaceObject": celpy.json_to_cel(namespace_obj),
            "params": None,
            "authorizer": None,  # not modelled: an expression that uses it errors
        }
        activation["variables"] = _LazyVariables(policy.variables, activation)
        return activation

    def _evaluate_policy(self, policy: _Policy, activation: dict[str, Any]) -> list[tuple[str, str]]:
        """(reason, message) of every failed validation; [] when the request passes or the policy
        does not apply (a matchCondition is false). Errors follow failurePolicy."""
        fail_on_error = policy.spec.get("failurePolicy", "Fail") == "Fail"
        if policy.compile_error:
            return [("Invalid", policy.compile_error)] if fail_on_error else []
        try:
            for cond_name, expression, program in policy.match_conditions:
                result = _evaluate(program, expression, activation)
                if not isinstance(result, celtypes.BoolType):
                    raise _CelError(f"matchCondition '{cond_name}' did not evaluate to a bool")
                if not result:
                    return []
        except _CelError as exc:
            return [("Invalid", str(exc))] if fail_on_error else []
        failures = []
        for validation, program, message_program in policy.validations:
            expression = validation["expression"]
            try:
                result = _evaluate(program, expression, activation)
            except _CelError as exc:
                if fail_on_error:
                    failures.append(("Invalid", str(exc)))
                continue
            if isinstance(result, celtypes.BoolType) and result:
                continue
            message = validation.get("message") or f"failed expression: {expression.strip()}"
            if message_program is not None:
                try:  # a failing or empty messageExpression falls back to message
                    text = _evaluate(message_program, validation["messageExpression"], activation)
                    if isinstance(text, str) and text.strip():
                        message = str(text)
                except _CelError:
                    pass
            failures.append((validation.get("reason", "Invalid"), message))
        return failures

    def admit(
        self,
        user: UserInfo,
        operation: str,
        api_group: str,
        api_version: str,
        resource: str,
        subresource: str,
        namespace: str,
        name: str,
        obj: dict[str, Any] | None,
        old_obj: dict[str, Any] | None,
        namespace_obj: dict[str, Any] | None,
    ) -> tuple[int, str] | None:
        """None when every bound policy admits the request, else (HTTP code, the apiserver's
        message) of the first denial. ``operation`` is CREATE/UPDATE/DELETE/CONNECT (a PATCH is
        an UPDATE with both objects, as the apiserver hands it to admission)."""
        self.warnings = []
        source = obj if obj is not None else old_obj
        # admission.NewForbidden names the object being created by its name or generateName.
        shown_name = (
            name
            or ((source or {}).get("metadata") or {}).get("name")
            or ((source or {}).get("metadata") or {}).get("generateName")
            or ""
        )
        kind = (source or {}).get("kind", "")
        request = {
            "uid": "fake-admission-request",
            "kind": {"group": api_group, "version": api_version, "kind": kind},
            "resource": {"group": api_group, "version": api_version, "resource": resource},
            "subResource": subresource,
            "requestKind": {"group": api_group, "version": api_version, "kind": kind},
            "requestResource": {"group": api_group, "version": api_version, "resource": resource},
            "requestSubResource": subresource,
            "name": name,
            "namespace": namespace,
            "operation": operation,
            "userInfo": {"username": user.username, "groups": list(user.groups)},
            "dryRun": False,
        }
        namespace_labels = dict(_labels(namespace_obj))
        if namespace:  # the apiserver labels every namespace with its name
            namespace_labels.setdefault("kubernetes.io/metadata.name", namespace)
        if namespace and namespace_obj is None:
            namespace_obj = {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": namespace, "labels": namespace_labels},
            }
        if not namespace:
            namespace_obj = None
        denial = None
        for binding in self.bindings:
            policy = self.policies.get((binding.get("spec") or {}).get("policyName", ""))
            if policy is None:
                continue  # a binding to a missing policy: nothing to enforce here
            if not self._matches(policy.spec.get("matchConstraints"), request, obj, old_obj, namespace_labels):
                continue
            if not self._matches(
                (binding.get("spec") or {}).get("matchResources"), request, obj, old_obj, namespace_labels
            ):
                continue
            activation = self._activation(policy, user, request, obj, old_obj, namespace_obj)
            actions = (binding.get("spec") or {}).get("validationActions") or []
            binding_name = binding["metadata"]["name"]
            for reason, message in self._evaluate_policy(policy, activation):
                if "Deny" in actions:
                    if denial is None:
                        text = (
                            f"ValidatingAdmissionPolicy '{policy.name}' with binding "
                            f"'{binding_name}' denied request: {message}"
                        )
                        denial = (
                            REASON_CODES.get(reason, 422),
                            forbidden_message(api_group, resource, shown_name, text),
                        )
                elif "Warn" in actions or "Audit" in actions:
                    self.warnings.append((policy.name, binding_name, message))
        return denial
