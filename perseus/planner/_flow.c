/* Primal network simplex for min-cost flow with real costs and capacities.
 *
 * The planner's LP relaxation is a tension problem on the schedule's DAG (perseus.planner.flow);
 * its dual is a min-cost flow, and the node potentials of an optimal spanning tree are the
 * relaxation's optimal start and end times. HiGHS solves the same LP with general LU-based
 * simplex; a spanning-tree pivot costs only the length of its cycle and the size of the subtree it
 * moves, which is what makes large pipelines tractable.
 *
 * Tree: every node has a parent (the root has none), the tree arc to it and its direction (+1:
 * the arc runs node -> parent), a depth, and intrusive child lists so that a moved subtree can be
 * walked. The caller gives a feasible first tree (perseus.planner.flow builds one from the
 * schedule), so there is no phase of artificial arcs. Potentials keep every tree arc's reduced cost
 * cost + pi[source] - pi[target] at zero. Ties for the leaving arc go to the last blocking arc on
 * the cycle oriented from its apex (a strongly feasible tree: no cycling on degenerate pivots).
 *
 * The module also holds the DAG's longest path for one assignment of node times (`longest_path`,
 * perseus.planner.dag), which the evaluator and the EnvPipe baseline run hundreds of times on a
 * large pipeline: a Python loop over 32,768 instructions takes milliseconds each time; and the
 * rounding's scalar passes over the DAG (`walk`, `latest_finish`, `exchange`: perseus.planner.rounding)
 * and a stage's replay with clock switch latencies (`replay`: perseus.planner.switches), with the
 * same float operations as their Python versions, so the same plans.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { AT_LOWER = 1, IN_TREE = 0, AT_UPPER = -1 };
enum { OPTIMAL = 0, UNBOUNDED = 2, PIVOT_LIMIT = 3 };

typedef struct {
    int nodes;  /* real nodes; node `nodes` is the root */
    int real;   /* real arcs; arc real + i is node i's artificial arc */
    int *src, *dst;
    double *cost, *cap, *flow;
    signed char *state;
    int *parent, *pred, *depth, *first, *next, *prev, *stack;
    signed char *dir;
    double *pi;
    double eps;
} Tree;

static void unlink_child(Tree *t, int u, int par) {
    if (t->prev[u] >= 0)
        t->next[t->prev[u]] = t->next[u];
    else
        t->first[par] = t->next[u];
    if (t->next[u] >= 0) t->prev[t->next[u]] = t->prev[u];
}

static void link_child(Tree *t, int u, int par) {
    t->prev[u] = -1;
    t->next[u] = t->first[par];
    if (t->first[par] >= 0) t->prev[t->first[par]] = u;
    t->first[par] = u;
}

/* Shift the potentials of the subtree rooted at `top` by `sigma` and set its depths. */
static void move_subtree(Tree *t, int top, double sigma) {
    int sp = 0;
    t->stack[sp++] = top;
    while (sp) {
        int u = t->stack[--sp];
        t->pi[u] += sigma;
        t->depth[u] = t->depth[t->parent[u]] + 1;
        for (int c = t->first[u]; c >= 0; c = t->next[c]) t->stack[sp++] = c;
    }
}

/* Potentials from the root down, exactly: drops what the pivots' shifts accumulated. */
static void recompute_potentials(Tree *t) {
    int root = t->nodes, sp = 0;
    t->pi[root] = 0.0;
    for (int c = t->first[root]; c >= 0; c = t->next[c]) t->stack[sp++] = c;
    while (sp) {
        int u = t->stack[--sp];
        t->pi[u] = t->pi[t->parent[u]] - t->dir[u] * t->cost[t->pred[u]];
        for (int c = t->first[u]; c >= 0; c = t->next[c]) t->stack[sp++] = c;
    }
}

static double reduced(const Tree *t, int e) {
    return t->state[e] * (t->cost[e] + t->pi[t->src[e]] - t->pi[t->dst[e]]);
}

/* Block search over the real arcs: the most violating arc of the first block that has one. */
static int entering(Tree *t, int *cursor) {
    int m = t->real, block = (int)sqrt((double)m);
    if (block < 16) block = 16;
    int best = -1, count = block;
    double most = -t->eps;
    for (int k = 0; k < m; k++) {
        int e = *cursor;
        *cursor = e + 1 == m ? 0 : e + 1;
        double r = reduced(t, e);
        if (r < most) {
            most = r;
            best = e;
        }
        if (--count == 0) {
            if (best >= 0) return best;
            count = block;
        }
    }
    return best;
}

/* One pivot on entering arc e; UNBOUNDED if the cycle has no finite residual. */
static int pivot(Tree *t, int e) {
    /* Flow goes from `from` up to the apex, down to `to`, then across e back to `from`. */
    int from = t->state[e] == AT_LOWER ? t->dst[e] : t->src[e];
    int to = t->state[e] == AT_LOWER ? t->src[e] : t->dst[e];
    int a = from, b = to;
    while (a != b) {
        if (t->depth[a] > t->depth[b])
            a = t->parent[a];
        else if (t->depth[b] > t->depth[a])
            b = t->parent[b];
        else {
            a = t->parent[a];
            b = t->parent[b];
        }
    }
    int apex = a;
    double from_min = HUGE_VAL, to_min = HUGE_VAL;
    int from_node = -1, to_node = -1;
    for (int u = from; u != apex; u = t->parent[u]) {  /* traversed u -> parent */
        int arc = t->pred[u];
        double r = t->dir[u] == 1 ? t->cap[arc] - t->flow[arc] : t->flow[arc];
        if (r <= from_min) {  /* ties: the one nearest the apex is last on the cycle */
            from_min = r;
            from_node = u;
        }
    }
    for (int u = to; u != apex; u = t->parent[u]) {  /* traversed parent -> u */
        int arc = t->pred[u];
        double r = t->dir[u] == -1 ? t->cap[arc] - t->flow[arc] : t->flow[arc];
        if (r < to_min) {  /* ties: the one nearest `to` is last on the cycle */
            to_min = r;
            to_node = u;
        }
    }
    double delta = t->cap[e];
    if (from_min < delta) delta = from_min;
    if (to_min < delta) delta = to_min;
    if (isinf(delta)) return UNBOUNDED;
    if (delta > 0) {
        t->flow[e] += t->state[e] * delta;
        for (int u = from; u != apex; u = t->parent[u]) t->flow[t->pred[u]] += t->dir[u] * delta;
        for (int u = to; u != apex; u = t->parent[u]) t->flow[t->pred[u]] -= t->dir[u] * delta;
    }
    int w, q, upper;
    if (from_min == delta) {
        w = from_node;
        q = from;
        upper = t->dir[w] == 1;
    } else if (t->cap[e] == delta) {
        t->state[e] = (signed char)-t->state[e];
        t->flow[e] = t->state[e] == AT_UPPER ? t->cap[e] : 0.0;
        return OPTIMAL;
    } else {
        w = to_node;
        q = to;
        upper = t->dir[w] == -1;
    }
    int leaving = t->pred[w];
    t->state[leaving] = upper ? AT_UPPER : AT_LOWER;
    t->flow[leaving] = upper ? t->cap[leaving] : 0.0;
    t->state[e] = IN_TREE;
    /* Hang w's subtree from e: reverse the path q .. w, then q's parent is e's other end. */
    int p = t->src[e] == q ? t->dst[e] : t->src[e];
    int par = p, arc = e;
    signed char d = t->src[e] == q ? 1 : -1;
    for (int u = q;;) {
        int old_parent = t->parent[u], old_arc = t->pred[u];
        signed char old_dir = t->dir[u];
        unlink_child(t, u, old_parent);
        t->parent[u] = par;
        t->pred[u] = arc;
        t->dir[u] = d;
        link_child(t, u, par);
        if (u == w) break;
        par = u;
        arc = old_arc;
        d = (signed char)-old_dir;
        u = old_parent;
    }
    double sigma = t->pi[p] - t->dir[q] * t->cost[e] - t->pi[q];
    move_subtree(t, q, sigma);
    return OPTIMAL;
}

static int run(Tree *t, long long max_pivots, long long *pivots) {
    double big = 0.0;
    for (int e = 0; e < t->real; e++) big = fmax(big, fabs(t->cost[e]));
    /* Potentials are sums of at most `nodes` costs: reduced costs are exact to about this. */
    t->eps = (t->nodes + 1.0) * (big + 1.0) * 1e-14;
    recompute_potentials(t);
    int cursor = 0;
    *pivots = 0;
    for (;;) {
        int e = entering(t, &cursor);
        if (e < 0) {
            /* Optimal on drifted potentials: check again on exact ones. */
            recompute_potentials(t);
            e = entering(t, &cursor);
            if (e < 0) return OPTIMAL;
        }
        if (*pivots >= max_pivots) return PIVOT_LIMIT;
        if (pivot(t, e) == UNBOUNDED) return UNBOUNDED;
        if (++*pivots % 4096 == 0) recompute_potentials(t);
    }
}

static int get_array(PyObject *obj, Py_buffer *view, const char *format, Py_ssize_t length, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) return -1;
    if (view->ndim != 1 || strcmp(view->format, format) != 0 || view->shape[0] != length) {
        PyErr_Format(PyExc_ValueError, "%s must be a writable contiguous 1-d array of %zd items of format '%s'", name,
                     length, format);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

#define ARRAYS 14

static PyObject *network_simplex(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[ARRAYS];
    int real;
    long long max_pivots;
    if (!PyArg_ParseTuple(args, "iOOOOOOOOOOOOOOL", &real, &objs[0], &objs[1], &objs[2], &objs[3], &objs[4],
                          &objs[5], &objs[6], &objs[7], &objs[8], &objs[9], &objs[10], &objs[11], &objs[12],
                          &objs[13], &max_pivots))
        return NULL;
    /* Arcs (real ones, then one per node that may join the root), then nodes (the root last). */
    static const char *names[ARRAYS] = {"src", "dst",   "cap",   "cost", "flow", "state", "parent",
                                        "pred", "dir", "depth", "first", "next", "prev",  "pi"};
    static const char *formats[ARRAYS] = {"i", "i", "d", "d", "d", "b", "i", "i", "b", "i", "i", "i", "i", "d"};
    Py_ssize_t nodes = PyObject_Length(objs[6]), arcs = PyObject_Length(objs[0]);
    if (nodes < 1 || arcs < 0) return NULL;
    Py_ssize_t n = nodes - 1;
    if (arcs != real + n || real < 0 || arcs >= INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "the arc arrays must hold the real arcs and one root arc per node");
        return NULL;
    }
    Py_buffer views[ARRAYS];
    int got = 0;
    for (; got < ARRAYS; got++) {
        Py_ssize_t length = got < 6 ? arcs : nodes;
        if (get_array(objs[got], &views[got], formats[got], length, names[got]) < 0) goto fail;
    }
    int *stack = malloc(sizeof(int) * nodes);
    if (!stack) {
        PyErr_NoMemory();
        goto fail;
    }
    Tree t = {
        .nodes = (int)n,
        .real = real,
        .src = views[0].buf,
        .dst = views[1].buf,
        .cap = views[2].buf,
        .cost = views[3].buf,
        .flow = views[4].buf,
        .state = views[5].buf,
        .parent = views[6].buf,
        .pred = views[7].buf,
        .dir = views[8].buf,
        .depth = views[9].buf,
        .first = views[10].buf,
        .next = views[11].buf,
        .prev = views[12].buf,
        .pi = views[13].buf,
        .stack = stack,
    };
    long long pivots = 0;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = run(&t, max_pivots, &pivots);
    Py_END_ALLOW_THREADS
    free(stack);
    for (int i = 0; i < ARRAYS; i++) PyBuffer_Release(&views[i]);
    return Py_BuildValue("(iL)", status, pivots);
fail:
    for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    return NULL;
}

/* Nodes in topological order: node i starts when the last of its predecessors
 * pred_idx[pred_ptr[i] .. pred_ptr[i + 1]) ends (0 without one) and ends times[i] later. */
static PyObject *longest_path(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[5];
    if (!PyArg_ParseTuple(args, "OOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4])) return NULL;
    Py_ssize_t n = PyObject_Length(objs[2]), edges = PyObject_Length(objs[1]);
    if (n < 0 || edges < 0) return NULL;
    static const char *names[5] = {"pred_ptr", "pred_idx", "times", "start", "end"};
    static const char *formats[5] = {"i", "i", "d", "d", "d"};
    Py_ssize_t lengths[5] = {n + 1, edges, n, n, n};
    Py_buffer views[5];
    int got = 0;
    for (; got < 5; got++)
        if (get_array(objs[got], &views[got], formats[got], lengths[got], names[got]) < 0) goto fail;
    const int *ptr = views[0].buf, *idx = views[1].buf;
    const double *times = views[2].buf;
    double *start = views[3].buf, *end = views[4].buf;
    /* Every predecessor must come before its node (reads stay in bounds, order is topological):
     * checked as it is read, in the same pass. */
    if (ptr[0] != 0 || ptr[n] != edges) goto bad;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ptr[i + 1] < ptr[i] || ptr[i + 1] > edges) goto bad;
        double s = 0.0;
        for (int k = ptr[i]; k < ptr[i + 1]; k++) {
            int j = idx[k];
            if (j < 0 || j >= i) goto bad;
            if (k == ptr[i] || end[j] > s) s = end[j];
        }
        start[i] = s;
        end[i] = s + times[i];
    }
    for (int i = 0; i < 5; i++) PyBuffer_Release(&views[i]);
    Py_RETURN_NONE;
bad:
    PyErr_SetString(PyExc_ValueError, "pred_ptr/pred_idx must list each node's predecessors, all before it");
fail:
    for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    return NULL;
}

/* ---- The rounding's passes (perseus.planner.rounding) ----
 * Choices per node type: `time` and `cost` hold `width` columns per type, fastest (costliest)
 * first, padded with +inf; `count` says how many are real. Node i at choice k takes
 * time[node_type[i] * width + k]. Predecessors and successors in CSR form; nodes in topological order. */

typedef struct {
    Py_ssize_t n, edges, types;
    int width;
    const int *pred_ptr, *pred_idx, *succ_ptr, *succ_idx, *node_type, *count;
    const double *time, *cost;
} Graph;

/* How many of a row's choices end by `limit` when started at `start`: times rise along the row, so
 * those that do (start + time <= limit, exactly that float test) are a prefix. */
static int fitting(const double *row, int width, double start, double limit) {
    int lo = 0, hi = width;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (start + row[mid] <= limit)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static void walk_nodes(const Graph *g, const double *limit, int *choice, double *end) {
    for (Py_ssize_t i = 0; i < g->n; i++) {
        double s = 0.0;
        for (int k = g->pred_ptr[i]; k < g->pred_ptr[i + 1]; k++)
            if (k == g->pred_ptr[i] || end[g->pred_idx[k]] > s) s = end[g->pred_idx[k]];
        const double *row = g->time + (Py_ssize_t)g->node_type[i] * g->width;
        int c = fitting(row, g->width, s, limit[i]) - 1;
        if (c < 0) c = 0;
        choice[i] = c;
        end[i] = s + row[c];
    }
}

static void latest_nodes(const Graph *g, const int *choice, double deadline, double *latest) {
    for (Py_ssize_t i = g->n - 1; i >= 0; i--) {
        double v = deadline;
        for (int k = g->succ_ptr[i]; k < g->succ_ptr[i + 1]; k++) {
            int j = g->succ_idx[k];
            double w = latest[j] - g->time[(Py_ssize_t)g->node_type[j] * g->width + choice[j]];
            if (w < v) v = w;
        }
        latest[i] = v;
    }
}

/* One sweep of pair moves (see rounding._pair_sweep, the same moves): every input is a value of
 * the sweep's start state (`k`, `lf`), as a moved pair locks itself and its neighbours. */
static int sweep(const Graph *g, int *choice, const int *k, const double *lf, char *locked, double deadline,
                 int reach) {
    const int w = g->width;
    int moves = 0;
    memset(locked, 0, (size_t)g->n);
    for (Py_ssize_t i = 0; i < g->n; i++) {
        if (locked[i] || g->succ_ptr[i] == g->succ_ptr[i + 1]) continue;
        double start_i = 0.0;
        for (int p = g->pred_ptr[i]; p < g->pred_ptr[i + 1]; p++)
            if (lf[g->pred_idx[p]] > start_i) start_i = lf[g->pred_idx[p]];
        const int ti = g->node_type[i];
        const double *time_i = g->time + (Py_ssize_t)ti * w, *cost_i = g->cost + (Py_ssize_t)ti * w;
        const double ci = cost_i[k[i]];
        int best_j = -1, best_a = 0, best_b = 0;
        double best = 0.0;
        for (int e = g->succ_ptr[i]; e < g->succ_ptr[i + 1]; e++) {
            const int j = g->succ_idx[e];
            if (locked[j]) continue;
            /* i must end before its other successors must start, and by the deadline. */
            double limit_i = INFINITY;
            for (int f = g->succ_ptr[i]; f < g->succ_ptr[i + 1]; f++) {
                int s = g->succ_idx[f];
                if (s == j) continue;
                double room = lf[s] - g->time[(Py_ssize_t)g->node_type[s] * w + k[s]];
                if (room < limit_i) limit_i = room;
            }
            if (deadline < limit_i) limit_i = deadline;
            double others = 0.0;
            for (int p = g->pred_ptr[j]; p < g->pred_ptr[j + 1]; p++) {
                int q = g->pred_idx[p];
                if (q != i && lf[q] > others) others = lf[q];
            }
            const int tj = g->node_type[j];
            const double *time_j = g->time + (Py_ssize_t)tj * w, *cost_j = g->cost + (Py_ssize_t)tj * w;
            const double cj = cost_j[k[j]];
            int cap_b = k[j] + reach < g->count[tj] - 1 ? k[j] + reach : g->count[tj] - 1;
            double pair_best = -INFINITY;
            int pair_a = 0, pair_b = 0;
            for (int a = k[i] - reach; a <= k[i] + reach; a++) {
                if (a < 0 || a >= g->count[ti]) continue;
                double end_i = start_i + time_i[a];
                if (!(end_i <= limit_i)) continue;
                double start_j = end_i > others ? end_i : others;
                int b = fitting(time_j, w, start_j, lf[j]) - 1;
                if (b > cap_b) b = cap_b;
                if (b < 0) continue;
                double gain = (ci - cost_i[a]) + (cj - cost_j[b]);
                if (gain > pair_best) {
                    pair_best = gain;
                    pair_a = a;
                    pair_b = b;
                }
            }
            if (pair_best > 1e-9 && (best_j < 0 || pair_best > best)) {
                best = pair_best;
                best_j = j;
                best_a = pair_a;
                best_b = pair_b;
            }
        }
        if (best_j < 0) continue;
        choice[i] = best_a;
        choice[best_j] = best_b;
        moves++;
        const int pair[2] = {(int)i, best_j};
        for (int x = 0; x < 2; x++) {
            int u = pair[x];
            locked[u] = 1;
            for (int p = g->pred_ptr[u]; p < g->pred_ptr[u + 1]; p++) locked[g->pred_idx[p]] = 1;
            for (int s = g->succ_ptr[u]; s < g->succ_ptr[u + 1]; s++) locked[g->succ_idx[s]] = 1;
        }
    }
    return moves;
}

/* Parse (pred_ptr, pred_idx, succ_ptr, succ_idx, node_type, time, cost, count, width) and check that
 * every index read stays in bounds: CSR pointers rise to the edge count, predecessors come before
 * their node and successors after it, types and widths fit the tables. */
#define GRAPH_ARRAYS 8
static int get_graph(PyObject **objs, int width, Py_buffer *views, int *got, Graph *g) {
    static const char *names[GRAPH_ARRAYS] = {"pred_ptr", "pred_idx", "succ_ptr", "succ_idx",
                                              "node_type", "time", "cost", "count"};
    static const char *formats[GRAPH_ARRAYS] = {"i", "i", "i", "i", "i", "d", "d", "i"};
    Py_ssize_t n = PyObject_Length(objs[4]), edges = PyObject_Length(objs[1]), cells = PyObject_Length(objs[5]);
    Py_ssize_t types = PyObject_Length(objs[7]);
    if (n < 0 || edges < 0 || cells < 0 || types < 0) return -1;
    if (width < 1 || cells != types * width) {
        PyErr_SetString(PyExc_ValueError, "time and cost must hold `width` choices per type (count has one per type)");
        return -1;
    }
    Py_ssize_t lengths[GRAPH_ARRAYS] = {n + 1, edges, n + 1, edges, n, cells, cells, types};
    for (*got = 0; *got < GRAPH_ARRAYS; (*got)++)
        if (get_array(objs[*got], &views[*got], formats[*got], lengths[*got], names[*got]) < 0) return -1;
    *g = (Graph){n, edges, types, width, views[0].buf, views[1].buf, views[2].buf, views[3].buf,
                 views[4].buf, views[7].buf, views[5].buf, views[6].buf};
    for (int side = 0; side < 2; side++) {
        const int *ptr = side ? g->succ_ptr : g->pred_ptr, *idx = side ? g->succ_idx : g->pred_idx;
        if (ptr[0] != 0 || ptr[n] != edges) goto bad;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (ptr[i + 1] < ptr[i] || ptr[i + 1] > edges) goto bad;
            for (int k = ptr[i]; k < ptr[i + 1]; k++)
                if (side ? idx[k] <= i || idx[k] >= n : idx[k] < 0 || idx[k] >= i) goto bad;
        }
    }
    for (Py_ssize_t t = 0; t < types; t++)
        if (g->count[t] < 1 || g->count[t] > width) {
            PyErr_SetString(PyExc_ValueError, "count must be between 1 and width for every type");
            return -1;
        }
    for (Py_ssize_t i = 0; i < n; i++)
        if (g->node_type[i] < 0 || g->node_type[i] >= types) {
            PyErr_SetString(PyExc_ValueError, "node_type must index the types of count");
            return -1;
        }
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError,
                    "pred_ptr/pred_idx and succ_ptr/succ_idx must list each node's predecessors (all before it) and "
                    "successors (all after it)");
    return -1;
}

static int check_choice(const Graph *g, const int *choice) {
    for (Py_ssize_t i = 0; i < g->n; i++)
        if (choice[i] < 0 || choice[i] >= g->count[g->node_type[i]]) {
            PyErr_Format(PyExc_ValueError, "choice[%zd] = %d is not a choice of its type", i, choice[i]);
            return -1;
        }
    return 0;
}

/* Shared by the three entry points: the graph, then `extra` more arrays of the given formats. */
static PyObject *rounding_call(PyObject *args, int op) {
    PyObject *objs[GRAPH_ARRAYS + 2];
    int width, reach = 0;
    double number = 0.0;
    int ok;
    if (op == 0)
        ok = PyArg_ParseTuple(args, "OOOOOOOOiOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                              &objs[6], &objs[7], &width, &objs[8], &objs[9]);
    else if (op == 1)
        ok = PyArg_ParseTuple(args, "OOOOOOOOiOdO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                              &objs[6], &objs[7], &width, &objs[8], &number, &objs[9]);
    else
        ok = PyArg_ParseTuple(args, "OOOOOOOOiOdi", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                              &objs[6], &objs[7], &width, &objs[8], &number, &reach);
    if (!ok) return NULL;
    Py_buffer views[GRAPH_ARRAYS + 2];
    int got = 0, extra = 0;
    Graph g;
    PyObject *result = NULL;
    if (get_graph(objs, width, views, &got, &g) < 0) goto done;
    /* walk: limit (d), choice out (i); latest_finish: choice (i), latest out (d); exchange: choice (i). */
    static const char *formats[3][2] = {{"d", "i"}, {"i", "d"}, {"i", ""}};
    static const char *names[3][2] = {{"limit", "choice"}, {"choice", "latest"}, {"choice", ""}};
    for (; extra < (op == 2 ? 1 : 2); extra++)
        if (get_array(objs[GRAPH_ARRAYS + extra], &views[GRAPH_ARRAYS + extra], formats[op][extra], g.n,
                      names[op][extra]) < 0)
            goto done;
    if (op == 0) {
        double *end = malloc(sizeof(double) * (size_t)(g.n + 1));
        if (!end) {
            PyErr_NoMemory();
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS
        walk_nodes(&g, views[GRAPH_ARRAYS].buf, views[GRAPH_ARRAYS + 1].buf, end);
        Py_END_ALLOW_THREADS
        free(end);
        result = Py_NewRef(Py_None);
    } else if (op == 1) {
        if (check_choice(&g, views[GRAPH_ARRAYS].buf) < 0) goto done;
        Py_BEGIN_ALLOW_THREADS
        latest_nodes(&g, views[GRAPH_ARRAYS].buf, number, views[GRAPH_ARRAYS + 1].buf);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    } else {
        int *choice = views[GRAPH_ARRAYS].buf;
        if (check_choice(&g, choice) < 0) goto done;
        if (reach < 0) {
            PyErr_SetString(PyExc_ValueError, "reach must be at least 0");
            goto done;
        }
        size_t n = (size_t)g.n + 1;
        int *k = malloc(sizeof(int) * n);
        double *lf = malloc(sizeof(double) * n);
        char *locked = malloc(n);
        if (!k || !lf || !locked) {
            free(k);
            free(lf);
            free(locked);
            PyErr_NoMemory();
            goto done;
        }
        long long moves = 0;
        Py_BEGIN_ALLOW_THREADS
        for (;;) {
            latest_nodes(&g, choice, number, lf);
            memcpy(k, choice, sizeof(int) * (size_t)g.n);
            int made = sweep(&g, choice, k, lf, locked, number, reach);
            if (!made) break;
            moves += made;
        }
        Py_END_ALLOW_THREADS
        free(k);
        free(lf);
        free(locked);
        result = PyLong_FromLongLong(moves);
    }
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    for (int i = 0; i < extra; i++) PyBuffer_Release(&views[GRAPH_ARRAYS + i]);
    return result;
}

static PyObject *walk(PyObject *self, PyObject *args) {
    (void)self;
    return rounding_call(args, 0);
}

static PyObject *latest_finish(PyObject *self, PyObject *args) {
    (void)self;
    return rounding_call(args, 1);
}

static PyObject *exchange(PyObject *self, PyObject *args) {
    (void)self;
    return rounding_call(args, 2);
}

/* ---- A stage's replay with clock switch latencies (perseus.planner.switches.stage_run) ----
 * Clocks are columns of the stage's tables (ascending MHz, so comparing columns compares clocks);
 * lat[c] and lead[c] are the switch latency to clock c and how early a change up to it is asked. */

typedef struct {
    double since, asked;
    int column;
} Force;

static Py_ssize_t clock_changes_c(Py_ssize_t n, const int *col, const double *start, const double *lat,
                                  const double *lead, Force *calls, Force *force) {
    /* Calls: one per segment whose clock differs from the one before it (the first segment's
     * "before" is the last instruction's: the plan repeats). */
    Py_ssize_t m = 0, prev_start = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i > 0 && col[i] == col[i - 1]) continue;
        int target = col[i], previous = col[i == 0 ? n - 1 : i - 1];
        Py_ssize_t segment_before = prev_start;
        prev_start = i;
        if (target == previous) continue;
        double at = start[i];
        if (target > previous) {
            at -= lead[target];
            if (segment_before >= 0 && !(start[segment_before] <= at)) at = start[segment_before];
        }
        /* Stable insertion by asked time (calls come nearly in order). */
        Py_ssize_t k = m++;
        while (k > 0 && calls[k - 1].asked > at) {
            calls[k] = calls[k - 1];
            k--;
        }
        calls[k].asked = at;
        calls[k].column = target;
    }
    Py_ssize_t f = 0;
    force[f++] = (Force){-INFINITY, -INFINITY, n ? col[n - 1] : 0};
    int pending = 0;
    Force last = {0, 0, 0};
    for (Py_ssize_t k = 0; k < m; k++) {
        if (pending && last.since <= calls[k].asked) force[f++] = last;
        last = (Force){calls[k].asked + lat[calls[k].column], calls[k].asked, calls[k].column};
        pending = 1;
    }
    if (pending) force[f++] = last;
    return f;
}

static void replay_stage(Py_ssize_t n, Py_ssize_t cols, const int *col, const double *start, const double *lat,
                         const double *lead, const double *time, const double *energy, Force *calls, Force *force,
                         double *times, double *energies) {
    Py_ssize_t f = clock_changes_c(n, col, start, lat, lead, calls, force), k = 0;
    for (Py_ssize_t p = 0; p < n; p++) {
        double begin = start[p];
        while (k + 1 < f && force[k + 1].since <= begin) k++;
        Py_ssize_t j = k + 1;
        while (j < f && force[j].asked <= begin) j++;
        double now = begin, left = 1.0, e_sum = 0.0;
        for (Py_ssize_t q = k; q < j; q++) {
            double until = q + 1 < j ? force[q + 1].since : INFINITY;
            double t = time[p * cols + force[q].column], e = energy[p * cols + force[q].column];
            if (now + left * t <= until) {
                e_sum += left * e;
                now += left * t;
                break;
            }
            double done = (until - now) / t;
            left -= done;
            e_sum += done * e;
            now = until;
        }
        times[p] = now - begin;
        energies[p] = e_sum;
    }
}

static PyObject *replay(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[8];
    int queue = 0;
    if (!PyArg_ParseTuple(args, "OOOOOOOO|p", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &objs[6],
                          &objs[7], &queue))
        return NULL;
    Py_ssize_t n = PyObject_Length(objs[0]), cols = PyObject_Length(objs[2]);
    if (n < 0 || cols < 0) return NULL;
    static const char *names[8] = {"column", "start", "latency", "lead", "time", "energy", "times", "energies"};
    static const char *formats[8] = {"i", "d", "d", "d", "d", "d", "d", "d"};
    Py_ssize_t lengths[8] = {n, n, cols, cols, n * cols, n * cols, n, n};
    Py_buffer views[8];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 8; got++)
        if (get_array(objs[got], &views[got], formats[got], lengths[got], names[got]) < 0) goto done;
    const int *col = views[0].buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (col[i] < 0 || col[i] >= cols) {
            PyErr_Format(PyExc_ValueError, "column[%zd] = %d is not a column of the tables", i, col[i]);
            goto done;
        }
    Force *calls = malloc(sizeof(Force) * (size_t)(n + 1)), *force = malloc(sizeof(Force) * (size_t)(n + 2));
    double *begin = malloc(sizeof(double) * (size_t)(n + 1));
    if (!calls || !force || !begin) {
        free(calls);
        free(force);
        free(begin);
        PyErr_NoMemory();
        goto done;
    }
    const double *start = views[1].buf, *time = views[4].buf;
    if (queue) {
        /* Each instruction starts at its start or when the one before it ends at its planned clock,
         * whichever is later (a trial that slows instructions pushes the ones after them). */
        double free_at = -INFINITY;
        for (Py_ssize_t p = 0; p < n; p++) {
            double b = start[p];
            if (free_at > b) b = free_at;
            begin[p] = b;
            free_at = b + time[p * cols + col[p]];
        }
        start = begin;
    }
    double *times = views[6].buf, *energies = views[7].buf;
    replay_stage(n, cols, col, start, views[2].buf, views[3].buf, time, views[5].buf, calls, force, times, energies);
    free(calls);
    free(force);
    free(begin);
    /* Summed in order, as Python's left-to-right additions of the same floats. */
    double time_sum = 0.0, energy_sum = 0.0;
    for (Py_ssize_t p = 0; p < n; p++) {
        time_sum += times[p];
        energy_sum += energies[p];
    }
    result = Py_BuildValue("(dd)", time_sum, energy_sum);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"replay", replay, METH_VARARGS,
     "replay(column, start, latency, lead, time, energy, times, energies, queue=False) -> (float, float)\n\n"
     "A stage's instructions run at clock columns `column` (int32) from `start` with clock changes that take "
     "latency[c] (asked lead[c] early when the clock rises), as perseus.planner.switches.stage_run; time and "
     "energy are (instructions x columns) tables; each instruction's time and energy written to times and "
     "energies in place, and returned summed (in order). `queue`: each starts no earlier than the one before it "
     "ends at its planned clock."},
    {"walk", walk, METH_VARARGS,
     "walk(pred_ptr, pred_idx, succ_ptr, succ_idx, node_type, time, cost, count, width, limit, choice) -> None\n\n"
     "Topological pass: each node starts when its predecessors end and takes the slowest choice that ends by "
     "limit[i] (its fastest if none does); written to choice (int32) in place."},
    {"latest_finish", latest_finish, METH_VARARGS,
     "latest_finish(pred_ptr, pred_idx, succ_ptr, succ_idx, node_type, time, cost, count, width, choice, deadline, "
     "latest) -> None\n\n"
     "Latest end of every node such that, with its successors at their choices, the iteration ends by the "
     "deadline; written to latest (float64) in place."},
    {"exchange", exchange, METH_VARARGS,
     "exchange(pred_ptr, pred_idx, succ_ptr, succ_idx, node_type, time, cost, count, width, choice, deadline, "
     "reach) -> moves\n\n"
     "Sweeps of improving pair moves (rounding._pair_sweep's) on choice (int32, in place) until one makes "
     "none; the number of moves made."},
    {"longest_path", longest_path, METH_VARARGS,
     "longest_path(pred_ptr, pred_idx, times, start, end) -> None\n\n"
     "Earliest start and end of every node of a DAG in topological order (predecessors in CSR form, int32), "
     "given its times; start and end (float64) are written in place."},
    {"network_simplex", network_simplex, METH_VARARGS,
     "network_simplex(real, src, dst, cap, cost, flow, state, parent, pred, dir, depth, first, next, prev, pi, "
     "max_pivots) -> (status, pivots)\n\n"
     "Min-cost flow on `real` arcs src -> dst (int32) with capacity cap (inf: none) and cost per unit, from the "
     "feasible spanning tree given (flow, state: 1 at zero, 0 in the tree, -1 at capacity; per node its "
     "parent, the arc to it, dir +1 if that arc runs node -> parent, depth and child lists), written in place. "
     "The arc arrays hold one more slot per node (an arc joining it to the root, in the tree for the root's "
     "children) and the node arrays one more (the root, last). On status 0 (optimal) pi holds node potentials "
     "with reduced costs cost + pi[src] - pi[dst] >= 0 on arcs below capacity and <= 0 on arcs at it; "
     "2: unbounded (a negative cycle without capacity); 3: max_pivots reached."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_flow", "The planner's network simplex, the DAG's longest path, the rounding's passes and the switch replay.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__flow(void) { return PyModule_Create(&module); }
