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
 * large pipeline: a Python loop over 32,768 instructions takes milliseconds each time.
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

static PyMethodDef methods[] = {
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

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_flow", "The planner's network simplex and the DAG's longest path.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__flow(void) { return PyModule_Create(&module); }
