#include "trace/trace-block_hybrid.h"
